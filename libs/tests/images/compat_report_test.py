"""The compatibility report of one image flavour (built by //images:compat_<flavour>) is ok.

The report is a build output, so `bazel test //...` re-checks exactly when the lock, the wheel
or paved's sources change; this test turns a failing report into a failing test that says why.
"""

import json
import os


def test_report_is_ok(runfile):
    report = json.loads(runfile("COMPAT_REPORT").read_text())
    assert report["flavour"] == os.environ["FLAVOUR"]
    checked = report["checked"]
    print(
        f"{report['flavour']}: {report['engine']} ({report['wheel']}): "
        f"{len(checked['paved_imports'])} paved imports, "
        f"{sum(len(o['overrides']) for o in checked['overrides'])} overrides in "
        f"{len(checked['overrides'])} vLLM base classes, "
        f"{len(checked['triton_vllm_backend_imports'])} Triton backend imports"
    )
    assert report["ok"], "vLLM compatibility check failed:\n  " + "\n  ".join(report["errors"])


def test_the_check_saw_what_paved_actually_uses(runfile):
    """Guards the collector itself: if it silently found nothing, the check would be vacuous."""
    checked = json.loads(runfile("COMPAT_REPORT").read_text())["checked"]
    assert "vllm.v1.sample.logits_processor.interface:LogitsProcessor" in checked["paved_imports"]
    assert "vllm.v1.worker.gpu.sample.logits_processor.interface:LogitsProcessor" in checked["paved_imports"]
    bases = {o["base"]: set(o["overrides"]) for o in checked["overrides"]}
    v1 = bases["vllm.v1.sample.logits_processor.interface.LogitsProcessor"]
    v2 = bases["vllm.v1.worker.gpu.sample.logits_processor.interface.LogitsProcessor"]
    assert {"apply", "update_state", "is_argmax_invariant", "validate_params"} <= v1
    assert {"apply", "add_request", "validate_params"} <= v2
    assert "vllm.logits_processors" in checked["entry_point_groups"]
    # paved's processor derives from both runners' interfaces, so both runners' behaviour it
    # relies on was checked: the V1 async placeholder repair, and the fields V2 passes.
    assumptions = checked["runner_assumptions"]
    assert any("logitsprocs_need_output_token_ids" in a for a in assumptions)
    assert sum("read by paved's V2 path" in a for a in assumptions) == 4
    if os.environ["FLAVOUR"] == "gpu":
        assert len(checked["triton_vllm_backend_imports"]) > 10
