// pybind11 surface of cc/constraints. Every entry point validates shapes and dtypes before
// touching memory and releases the GIL around the C++ work, so the engine's Python thread
// is free while masks are applied.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "cc/constraints/token_bitmask.h"

namespace py = pybind11;
using paved::constraints::ApplyBitmaskRows;
using paved::constraints::BitmaskWords;

namespace {

void ApplyBitmask(py::array logits, py::array bitmask, py::object rows) {
  if (!py::isinstance<py::array_t<float>>(logits) || logits.ndim() != 2)
    throw py::value_error("logits must be a 2-D float32 array");
  if (!py::isinstance<py::array_t<int32_t>>(bitmask) || bitmask.ndim() != 2)
    throw py::value_error("bitmask must be a 2-D int32 array");
  if (!(logits.flags() & py::array::c_style) || !(bitmask.flags() & py::array::c_style))
    throw py::value_error("logits and bitmask must be C-contiguous");
  if (!logits.writeable()) throw py::value_error("logits must be writeable");
  const int64_t batch = logits.shape(0);
  const int64_t vocab = logits.shape(1);
  if (bitmask.shape(0) != batch || bitmask.shape(1) != BitmaskWords(vocab))
    throw py::value_error("bitmask shape must be [" + std::to_string(batch) + ", " +
                          std::to_string(BitmaskWords(vocab)) + "] for logits of shape [" +
                          std::to_string(batch) + ", " + std::to_string(vocab) + "]");
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> row_ids;
  const int64_t* row_ptr = nullptr;
  int64_t num_rows = batch;
  if (!rows.is_none()) {
    row_ids = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(rows);
    if (row_ids.ndim() != 1) throw py::value_error("rows must be 1-D");
    num_rows = row_ids.shape(0);
    for (int64_t i = 0; i < num_rows; ++i) {
      const int64_t r = row_ids.at(i);
      if (r < 0 || r >= batch) throw py::index_error("row " + std::to_string(r) + " out of range");
    }
    row_ptr = row_ids.data();
  }
  float* logits_ptr = static_cast<float*>(logits.mutable_data());
  const int32_t* mask_ptr = static_cast<const int32_t*>(bitmask.data());
  py::gil_scoped_release release;
  ApplyBitmaskRows(logits_ptr, mask_ptr, vocab, row_ptr, num_rows);
}

}  // namespace

PYBIND11_MODULE(_paved_constraints, m) {
  m.doc() = "paved's C++ constraint engine";
  m.def("bitmask_words", &BitmaskWords, py::arg("vocab_size"),
        "Number of int32 words per bitmask row for a vocabulary size.");
  m.def("apply_bitmask", &ApplyBitmask, py::arg("logits"), py::arg("bitmask"),
        py::arg("rows") = py::none(),
        "Set -inf in float32 logits [B, V] wherever the int32 bitmask [B, ceil(V/32)] bit is "
        "clear; only for `rows` when given. Releases the GIL.");
}
