// pybind11 surface of cc/constraints. Every entry point validates its arguments (shapes,
// dtypes, ranges) before touching memory, raises ValueError (ConstraintError) or IndexError,
// and releases the GIL around compilation and mask work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cc/constraints/batch_masker.h"
#include "cc/constraints/compile.h"
#include "cc/constraints/constraint.h"
#include "cc/constraints/limits.h"
#include "cc/constraints/token_bitmask.h"
#include "cc/constraints/vocab.h"

namespace py = pybind11;

namespace paved::constraints {
namespace {

// Checks a writeable, aligned, C-contiguous array of dtype T with the given shape.
// (An initializer_list keeps the per-step call allocation-free.)
template <typename T>
void CheckArray(const py::array& a, const char* name, const char* dtype, std::initializer_list<int64_t> shape) {
  if (!py::isinstance<py::array_t<T>>(a))
    throw py::value_error(std::string(name) + " must be a " + dtype + " array");
  bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
  py::ssize_t dim = 0;
  for (auto it = shape.begin(); ok && it != shape.end(); ++it) ok = a.shape(dim++) == *it;
  if (!ok) {
    std::string want = "[";
    for (auto it = shape.begin(); it != shape.end(); ++it) want += (it != shape.begin() ? ", " : "") + std::to_string(*it);
    throw py::value_error(std::string(name) + " shape must be " + want + "]");
  }
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + " must be C-contiguous");
  if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))
    throw py::value_error(std::string(name) + " must be aligned");
  if (!a.writeable()) throw py::value_error(std::string(name) + " must be writeable");
}

void ApplyBitmask(py::array logits, py::array bitmask, py::object rows) {
  if (!py::isinstance<py::array_t<float>>(logits) || logits.ndim() != 2)
    throw py::value_error("logits must be a 2-D float32 array");
  if (!py::isinstance<py::array_t<int32_t>>(bitmask) || bitmask.ndim() != 2)
    throw py::value_error("bitmask must be a 2-D int32 array");
  if (!(logits.flags() & py::array::c_style) || !(bitmask.flags() & py::array::c_style))
    throw py::value_error("logits and bitmask must be C-contiguous");
  // Read and written as float / uint32 (a misaligned one is undefined behaviour), like the
  // masker's arrays (CheckArray).
  if (!(logits.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_) ||
      !(bitmask.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))
    throw py::value_error("logits and bitmask must be aligned");
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

std::shared_ptr<Vocab> MakeVocab(std::vector<std::string> token_bytes, const std::vector<int64_t>& eos_token_ids,
                                 std::optional<int64_t> vocab_size) {
  // Vocab reads a negative size as "len(token_bytes)"; from Python only None means that.
  if (vocab_size && (*vocab_size <= 0 || *vocab_size > kMaxVocabSize))
    throw ConstraintError("vocab_size must be in [1, " + std::to_string(kMaxVocabSize) + "], got " +
                          std::to_string(*vocab_size));
  std::vector<int32_t> eos;
  for (int64_t id : eos_token_ids) {
    if (id < 0 || id >= kMaxVocabSize) throw ConstraintError("EOS token id " + std::to_string(id) + " is out of range");
    eos.push_back(static_cast<int32_t>(id));
  }
  py::gil_scoped_release release;
  return std::make_shared<Vocab>(std::move(token_bytes), std::move(eos), vocab_size.value_or(-1));
}

py::dict Stats(const Constraint& c) {
  const ConstraintStats s = c.stats();
  py::dict d;
  d["kind"] = s.kind;
  d["dfa_states"] = s.automaton_states;
  d["min_tokens"] = s.min_tokens;
  d["cached_masks"] = s.cache.entries;
  d["cache_capacity"] = s.cache.capacity;
  d["cache_bytes"] = s.cache.bytes;
  d["cache_pinned"] = s.cache.pinned;
  d["cache_hits"] = s.cache.hits;
  d["cache_misses"] = s.cache.misses;
  d["cache_evictions"] = s.cache.evictions;
  return d;
}

// The batch's states as raw pointers, kept alive by per-thread references to their Python
// objects for the duration of a call. Both vectors keep their capacity: no allocation once
// warmed up.
struct BatchStates {
  std::vector<py::object> owners;
  std::vector<const State*> rows;
};

// The C++ object behind `obj` if it is an initialized instance of `type` (or of a subclass),
// else nullptr. (An instance made by Type.__new__ alone has none yet, and pybind11's caster
// would hand out its uninitialized storage.)
template <typename T>
T* InitializedValue(PyObject* obj, const py::detail::type_info* type) {
  if (!PyObject_TypeCheck(obj, type->type)) return nullptr;
  auto v_h = reinterpret_cast<py::detail::instance*>(obj)->get_value_and_holder(type, false);
  return v_h && v_h.holder_constructed() ? v_h.value_ptr<T>() : nullptr;
}

// The states argument as a list or tuple (PySequence_Fast) and its length. Its length is the
// batch's: the arrays are checked against it and exactly its items are filled, whatever the
// original sequence's __len__ says, and no Python code runs between those checks and the fill.
struct StatesArg {
  py::object fast;
  int64_t rows;
};

StatesArg StatesOf(PyObject* states) {
  if (!PySequence_Check(states)) throw py::type_error("states must be a sequence of State or None");
  PyObject* fast = PySequence_Fast(states, "states must be a sequence of State or None");
  if (fast == nullptr) throw py::error_already_set();
  return {py::reinterpret_steal<py::object>(fast), static_cast<int64_t>(PySequence_Fast_GET_SIZE(fast))};
}

BatchStates& CollectStates(const StatesArg& states) {
  // pybind11's isinstance<State>() and cast<>() look the type up by typeid (hashing its name)
  // on every call: with a B=64 batch that was ~15% of a fill_bitmask step. The type_info looked
  // up once checks a State object's type by pointer instead (InitializedValue).
  static const py::detail::type_info* const state_type = py::detail::get_type_info(typeid(State));
  thread_local BatchStates batch;
  batch.owners.clear();
  batch.rows.clear();
  PyObject** items = PySequence_Fast_ITEMS(states.fast.ptr());
  const auto n = static_cast<size_t>(states.rows);
  // After a model step the rows' Python objects and States are out of the CPU caches, and each
  // row's type check, then its State, would miss in turn: prefetching them all first overlaps
  // the misses (at B=64 after a 32 MiB write: 11-13 µs from entry to the fill, 7-9 with it,
  // docs/benchmarks.md).
  for (size_t i = 0; i < n; ++i) __builtin_prefetch(items[i]);
  for (size_t i = 0; i < n; ++i) {
    const auto* inst = reinterpret_cast<py::detail::instance*>(items[i]);
    if (Py_TYPE(items[i]) != state_type->type || !inst->simple_layout) continue;
    const void* value = inst->simple_value_holder[0];
    __builtin_prefetch(value);
    __builtin_prefetch(static_cast<const char*>(value) + 64);
  }
  for (size_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    if (item == Py_None) {
      batch.rows.push_back(nullptr);
      continue;
    }
    const State* state = InitializedValue<State>(item, state_type);
    if (state == nullptr) {
      batch.owners.clear();
      batch.rows.clear();
      throw py::value_error("states[" + std::to_string(i) + "] must be a State or None");
    }
    batch.rows.push_back(state);
    batch.owners.push_back(py::reinterpret_borrow<py::object>(item));
  }
  return batch;
}

template <typename Work>
void RunBatch(BatchMasker& masker, const StatesArg& states, Work work) {
  BatchStates& batch = CollectStates(states);
  try {
    masker.Validate(batch.rows.data(), static_cast<int64_t>(batch.rows.size()));
    py::gil_scoped_release release;
    work(batch.rows.data(), static_cast<int64_t>(batch.rows.size()));
  } catch (...) {
    batch.owners.clear();
    throw;
  }
  batch.owners.clear();
}

// BatchMasker's per-step methods (fill_bitmask, fill_unique_bitmask, apply) are plain CPython
// methods (METH_FASTCALL), not pybind11 functions: after a model step pybind11's generic
// dispatch (the function record, the argument casters, numpy's type objects) is out of the CPU
// caches, and at B=64, V=128k it cost 10-25 µs of a ~110 µs fill_bitmask, where the whole
// numpy write of the same bytes takes 75-100 (docs/benchmarks.md). The common case (an aligned,
// writeable, C-contiguous ndarray of the dtype and shape wanted) is taken by reading the array's
// fields; anything else goes through CheckArray, which raises the same errors as before.

// Binds fastcall arguments to `names` (positional first, then keywords); TypeError otherwise.
template <size_t N>
void BindArgs(const char* fn, const char* const (&names)[N], PyObject* const* args, Py_ssize_t nargs,
              PyObject* kwnames, PyObject* (&out)[N]) {
  auto usage = [&] {
    std::string u = std::string(fn) + "() takes " + std::to_string(N) + " arguments (";
    for (size_t j = 0; j < N; ++j) u += (j ? ", " : "") + std::string(names[j]);
    return py::type_error(u + ")");
  };
  if (nargs < 0 || static_cast<size_t>(nargs) > N) throw usage();
  for (size_t j = 0; j < N; ++j) out[j] = j < static_cast<size_t>(nargs) ? args[j] : nullptr;
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    const char* name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
    if (name == nullptr) throw py::error_already_set();
    size_t slot = N;
    for (size_t j = 0; j < N; ++j)
      if (std::strcmp(name, names[j]) == 0) slot = j;
    if (slot == N) throw py::type_error(std::string(fn) + "() got an unexpected keyword argument '" + name + "'");
    if (out[slot] != nullptr)
      throw py::type_error(std::string(fn) + "() got multiple values for argument '" + name + "'");
    out[slot] = args[nargs + k];
  }
  for (PyObject* a : out)
    if (a == nullptr) throw usage();
}

// The masker behind `self` (the method descriptor has checked the type).
BatchMasker& SelfMasker(PyObject* self) {
  static const py::detail::type_info* const masker_type = py::detail::get_type_info(typeid(BatchMasker));
  BatchMasker* masker = InitializedValue<BatchMasker>(self, masker_type);
  if (masker == nullptr) throw py::type_error("the BatchMasker is not initialized (__init__ was not called)");
  return *masker;
}

// The data of array `a` after CheckArray's checks, reading the ndarray's fields when it is the
// plain case. type_num: numpy's number for T (pybind11's normalized constant).
template <typename T>
T* ArrayData(PyObject* a, const char* name, const char* dtype, int type_num, std::initializer_list<int64_t> shape) {
  constexpr int kFlags = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_ |
                         py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  constexpr char kNative = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? '<' : '>';
  if (!py::detail::npy_api::get().PyArray_Check_(a))
    throw py::type_error(std::string(name) + " must be a numpy " + dtype + " array");
  const auto* arr = py::detail::array_proxy(a);
  const auto* descr = py::detail::array_descriptor_proxy(arr->descr);
  const char order = descr->byteorder;
  bool plain = arr->nd == static_cast<int>(shape.size()) && (arr->flags & kFlags) == kFlags &&
               descr->type_num == type_num && (order == '=' || order == '|' || order == kNative);
  int d = 0;
  for (auto it = shape.begin(); plain && it != shape.end(); ++it) plain = arr->dimensions[d++] == *it;
  if (!plain) CheckArray<T>(py::reinterpret_borrow<py::array>(a), name, dtype, shape);
  return reinterpret_cast<T*>(arr->data);
}

// Runs body() and hands its result to Python, or sets the Python error of what it threw.
template <typename Body>
PyObject* Guarded(const Body& body) {
  try {
    return body();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (...) {
    py::detail::try_translate_exceptions();
  }
  return nullptr;
}

// What every batch method starts with: its arguments bound, the masker, and the states (first,
// so that the arrays are checked against the rows that will be filled).
template <size_t N>
struct BatchCall {
  PyObject* args[N];
  BatchMasker* masker;
  StatesArg states;
};

template <size_t N>
BatchCall<N> StartBatchCall(const char* fn, const char* const (&names)[N], PyObject* self, PyObject* const* args,
                            Py_ssize_t nargs, PyObject* kwnames) {
  BatchCall<N> call;
  BindArgs(fn, names, args, nargs, kwnames, call.args);
  call.masker = &SelfMasker(self);
  call.states = StatesOf(call.args[0]);
  return call;
}

PyObject* FillBitmaskMethod(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return Guarded([&]() -> PyObject* {
    static const char* const kNames[] = {"states", "bitmask"};
    auto [a, masker_ptr, states] = StartBatchCall("fill_bitmask", kNames, self, args, nargs, kwnames);
    BatchMasker& masker = *masker_ptr;
    const int64_t rows = states.rows;
    auto* out = ArrayData<int32_t>(a[1], "bitmask", "int32", py::detail::npy_api::NPY_INT32_,
                                   {rows, int64_t{masker.num_words()}});
    RunBatch(masker, states, [&](const State* const* r, int64_t n) { masker.FillBitmask(r, n, out); });
    Py_RETURN_NONE;
  });
}

PyObject* FillUniqueBitmaskMethod(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return Guarded([&]() -> PyObject* {
    static const char* const kNames[] = {"states", "unique", "row_index"};
    auto [a, masker_ptr, states] = StartBatchCall("fill_unique_bitmask", kNames, self, args, nargs, kwnames);
    BatchMasker& masker = *masker_ptr;
    const int64_t rows = states.rows;
    auto* out = ArrayData<int32_t>(a[1], "unique", "int32", py::detail::npy_api::NPY_INT32_,
                                   {rows, int64_t{masker.num_words()}});
    auto* index = ArrayData<int32_t>(a[2], "row_index", "int32", py::detail::npy_api::NPY_INT32_, {rows});
    // The engine writes both; an index inside the mask rows would be overwritten.
    const auto u0 = reinterpret_cast<uintptr_t>(out), i0 = reinterpret_cast<uintptr_t>(index);
    const auto unique_bytes = static_cast<uintptr_t>(rows) * static_cast<uintptr_t>(masker.num_words()) * 4;
    if (i0 < u0 + unique_bytes && u0 < i0 + static_cast<uintptr_t>(rows) * 4)
      throw py::value_error("unique and row_index must not overlap");
    if (rows > std::numeric_limits<int32_t>::max())
      throw py::value_error("fill_unique_bitmask takes at most 2**31 - 1 rows");
    int64_t n = 0;
    RunBatch(masker, states,
             [&](const State* const* r, int64_t count) { n = masker.FillUniqueBitmask(r, count, out, index); });
    return PyLong_FromLongLong(n);
  });
}

PyObject* ApplyMethod(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return Guarded([&]() -> PyObject* {
    static const char* const kNames[] = {"states", "logits"};
    auto [a, masker_ptr, states] = StartBatchCall("apply", kNames, self, args, nargs, kwnames);
    BatchMasker& masker = *masker_ptr;
    const int64_t rows = states.rows;
    auto* out = ArrayData<float>(a[1], "logits", "float32", py::detail::npy_api::NPY_FLOAT_,
                                 {rows, int64_t{masker.vocab_size()}});
    RunBatch(masker, states, [&](const State* const* r, int64_t n) { masker.Apply(r, n, out); });
    Py_RETURN_NONE;
  });
}

template <typename Fn>
PyCFunction AsCFunction(Fn* fn) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn));
}

PyMethodDef kBatchMethods[] = {
    {"fill_bitmask", AsCFunction(&FillBitmaskMethod), METH_FASTCALL | METH_KEYWORDS,
     "fill_bitmask($self, /, states, bitmask)\n--\n\n"
     "Fill int32 bitmask [len(states), ceil(V/32)]; rows whose state is None allow every token."},
    {"fill_unique_bitmask", AsCFunction(&FillUniqueBitmaskMethod), METH_FASTCALL | METH_KEYWORDS,
     "fill_unique_bitmask($self, /, states, unique, row_index)\n--\n\n"
     "Write each distinct mask of the batch once and return their count n: row i's mask is "
     "unique[row_index[i]]. unique: int32 [len(states), ceil(V/32)], whose rows from n on are "
     "scratch (unspecified); row_index: int32 [len(states)], not overlapping unique. For "
     "device-side gathers."},
    {"apply", AsCFunction(&ApplyMethod), METH_FASTCALL | METH_KEYWORDS,
     "apply($self, /, states, logits)\n--\n\n"
     "Set -inf in float32 logits [len(states), V] where not allowed; rows whose state is None are untouched."},
};

}  // namespace
}  // namespace paved::constraints

PYBIND11_MODULE(_paved_constraints, m) {
  using namespace paved::constraints;
  m.doc() = "paved's C++ constraint engine: regex / JSON Schema / catalogue constraints over token ids.";

  m.def(
      "bitmask_words",
      [](int64_t vocab_size) {
        if (vocab_size < 0 || vocab_size > std::numeric_limits<int64_t>::max() - 31)
          throw ConstraintError("vocab_size must be non-negative, got " + std::to_string(vocab_size));
        return BitmaskWords(vocab_size);
      },
      py::arg("vocab_size"),
        "Number of int32 words per bitmask row for a vocabulary size.");
  m.def("apply_bitmask", &ApplyBitmask, py::arg("logits"), py::arg("bitmask"), py::arg("rows") = py::none(),
        "Set -inf in float32 logits [B, V] wherever the int32 bitmask [B, ceil(V/32)] bit is "
        "clear; only for `rows` when given. Releases the GIL.");
  m.def(
      "check_regex",
      [](const std::string& pattern) {
        py::gil_scoped_release release;
        CheckRegex(pattern);
      },
      py::arg("pattern"), "Raise ValueError if the pattern is invalid, unsupported or too large.");
  m.def(
      "check_json_schema",
      [](const std::string& schema_json) {
        py::gil_scoped_release release;
        CheckJsonSchema(schema_json);
      },
      py::arg("schema_json"), "Raise ValueError if the JSON Schema is invalid, unsupported or too large.");

  py::class_<Vocab, std::shared_ptr<Vocab>>(m, "Vocab", "A tokenizer vocabulary: token id -> bytes, and EOS ids.")
      .def(py::init(&MakeVocab), py::arg("token_bytes"), py::arg("eos_token_ids"), py::arg("vocab_size") = py::none(),
           "token_bytes[id] is the token's bytes (b'' for special tokens); vocab_size (default "
           "len(token_bytes)) may be larger, e.g. a model's padded vocabulary. Ids without bytes are never "
           "allowed, except EOS ids in accepting states.")
      .def_property_readonly("size", &Vocab::size, "The (padded) vocabulary size V.");

  py::class_<Constraint, std::shared_ptr<Constraint>>(
      m, "Constraint", "An immutable compiled constraint, thread-safe and shared across requests.")
      .def_static(
          "regex",
          [](std::shared_ptr<Vocab> vocab, const std::string& pattern) {
            py::gil_scoped_release release;
            return CompileRegex(std::move(vocab), pattern);
          },
          py::arg("vocab"), py::arg("pattern"), "Full-match regex (see cc/constraints/README.md for the subset).")
      .def_static(
          "json_schema",
          [](std::shared_ptr<Vocab> vocab, const std::string& schema_json, const std::string& whitespace) {
            const JsonWhitespace ws = ParseJsonWhitespace(whitespace);
            py::gil_scoped_release release;
            return CompileJsonSchema(std::move(vocab), schema_json, ws);
          },
          py::arg("vocab"), py::arg("schema_json"), py::arg("whitespace") = "compact",
          "JSON text valid for the schema; whitespace is 'compact', 'standard' or 'free'.")
      .def_static(
          "choice",
          [](std::shared_ptr<Vocab> vocab, std::vector<std::string> items, int k, std::string separator,
             bool distinct) {
            py::gil_scoped_release release;
            return CompileChoice(std::move(vocab), std::move(items), k, std::move(separator), distinct);
          },
          py::arg("vocab"), py::arg("items"), py::arg("k") = 1, py::arg("separator") = ", ",
          py::arg("distinct") = false, "Exactly k catalogue items joined by separator, optionally all distinct.")
      .def(
          "new_state",
          [](const Constraint& c, std::optional<int64_t> max_tokens) {
            return std::shared_ptr<State>(c.NewState(max_tokens));
          },
          py::arg("max_tokens") = py::none(),
          "A per-request state. With max_tokens, the output always ends with EOS within that many tokens; "
          "raises ValueError if max_tokens < stats()['min_tokens'].")
      .def("stats", &Stats, "Automaton size, shortest output (min_tokens) and mask cache counters.");

  py::class_<State, std::shared_ptr<State>>(m, "State", "Per-request automaton state (not thread-safe).")
      .def(
          "advance",
          [](State& s, int64_t token_id) {
            if (token_id < 0 || token_id >= s.vocab().size())
              throw ConstraintError("token id " + std::to_string(token_id) + " is outside the vocabulary [0, " +
                                    std::to_string(s.vocab().size()) + ")");
            return s.Advance(static_cast<int32_t>(token_id));
          },
          py::arg("token_id"), "Consume token_id if allowed; False (state unchanged) otherwise.")
      .def("reset", &State::Reset, "Back to the start with nothing generated (preemption replay).")
      .def_property_readonly("is_accepting", &State::is_accepting)
      .def_property_readonly("is_finished", &State::is_finished)
      .def_property_readonly("num_generated", &State::num_generated)
      .def_property_readonly("max_tokens", &State::max_tokens)
      .def("allowed_tokens", &State::AllowedTokens, "Allowed token ids, ascending.")
      .def(
          "fill_bitmask_row",
          [](const State& s, py::array row) {
            CheckArray<int32_t>(row, "row", "int32", {int64_t{s.vocab().num_words()}});
            auto* out = static_cast<uint32_t*>(row.mutable_data());
            py::gil_scoped_release release;
            s.FillMask(out);
          },
          py::arg("row"), "Write the allowed-token bitmask into an int32 array of ceil(V/32) words.");

  py::class_<BatchMasker> masker(m, "BatchMasker", "Fills masks for a whole batch with a persistent thread pool.");
  masker.def(py::init([](int64_t vocab_size, int64_t num_threads) {
             if (vocab_size <= 0 || vocab_size > kMaxVocabSize)
               throw ConstraintError("vocab_size must be in [1, " + std::to_string(kMaxVocabSize) + "]");
             if (num_threads < 1 || num_threads > 256) throw ConstraintError("num_threads must be in [1, 256]");
             return std::make_unique<BatchMasker>(static_cast<int32_t>(vocab_size), static_cast<int>(num_threads));
           }),
           py::arg("vocab_size"), py::arg("num_threads") = 2,
           "num_threads counts the calling thread; the others are persistent workers.");
  // fill_bitmask, fill_unique_bitmask and apply: see kBatchMethods.
  for (PyMethodDef& def : kBatchMethods) {
    PyObject* method = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(masker.ptr()), &def);
    if (method == nullptr) throw py::error_already_set();
    masker.attr(def.ml_name) = py::reinterpret_steal<py::object>(method);
  }
}
