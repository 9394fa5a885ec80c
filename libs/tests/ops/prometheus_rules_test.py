"""The Prometheus rules in ops/prometheus: `promtool check rules` and `promtool test rules` (input
series -> recorded values and alerts: an availability burn paging and resolving, a latency burn,
cache hit rates, TTFT percentiles, fleet alerts), the generated SLO file is what slos.yaml gives,
the SLO config is validated, and every metric a rule reads is one paved really exports (the
gateway's registry, a simulated frontend's /metrics, the control plane's /metrics families and
vLLM's own metric definitions in the installed vllm)."""

from __future__ import annotations

import ast
import asyncio
import glob
import importlib.util
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families
from servers import serve_engines

from paved.control_plane.prometheus import (
    RULE_FILES,
    SLO_RULES_FILE,
    SLOS_FILE,
    control_plane_families,
    parse_slos,
    regenerate,
    render_slo_rules,
    slo_rules,
)
from paved.control_plane.store import ControlStore
from paved.engine.sim import SimEngine
from paved.engine.sim_config import SimConfig
from paved.gateway.metrics import GatewayMetrics
from paved.runfiles import runfile

PROMTOOL = "/usr/bin/promtool"


def promtool() -> str:
    """Debian's promtool; a missing one fails (never skips) with how to install it."""
    if not os.access(PROMTOOL, os.X_OK):
        pytest.fail(
            f"{PROMTOOL} is missing: the Prometheus rule tests need Debian's prometheus package "
            "(`sudo apt-get install prometheus`; tools/bazel installs it with the other system packages)"
        )
    return PROMTOOL


def ops_dir() -> Path:
    return Path(runfile(f"ops/prometheus/{SLOS_FILE}")).parent


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_promtool_check_rules() -> None:
    root = ops_dir()
    result = run_promtool("check", "rules", *RULE_FILES, cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_FILES)


def test_promtool_unit_tests() -> None:
    root = ops_dir()
    tests = sorted(str(Path(p).relative_to(root)) for p in glob.glob(str(root / "tests" / "*.test.yml")))
    assert {"tests/slo.test.yml", "tests/layers.test.yml"} <= set(tests)
    result = run_promtool("test", "rules", *tests, cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(tests)


def test_a_wrong_expectation_fails_promtool(tmp_path: Path) -> None:
    """The unit tests can fail: the availability test expecting the page still firing after the
    short windows are clean is refused."""
    root = ops_dir()
    text = (root / "tests" / "slo.test.yml").read_text()
    text = text.replace("../rules/slo.rules.yml", str(root / SLO_RULES_FILE))
    mutated = text.replace("eval_time: 125m", "eval_time: 100m")
    assert mutated != text
    (tmp_path / "mutated.test.yml").write_text(mutated)
    result = run_promtool("test", "rules", "mutated.test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert 'severity="page"' in result.stdout + result.stderr


def test_the_generated_slo_rules_are_up_to_date(tmp_path: Path) -> None:
    root = ops_dir()
    assert regenerate(root, check=True), (
        f"{SLO_RULES_FILE} is stale: run `PYTHONPATH=libs .venv/bin/python -m paved.control_plane.prometheus`"
    )
    # And check mode writes nothing: a stale copy stays stale.
    copy = tmp_path / "ops"
    (copy / "rules").mkdir(parents=True)
    (copy / SLOS_FILE).write_text(
        (root / SLOS_FILE).read_text().replace("availability: 99.9", "availability: 99.5")
    )
    (copy / SLO_RULES_FILE).write_text((root / SLO_RULES_FILE).read_text())
    assert not regenerate(copy, check=True)
    assert (copy / SLO_RULES_FILE).read_text() == (root / SLO_RULES_FILE).read_text()
    assert not regenerate(copy)
    assert "> 0.072" in (copy / SLO_RULES_FILE).read_text()  # 14.4 x 0.5 %
    assert regenerate(copy, check=True)


def test_overrides_give_disjoint_selectors_that_promtool_accepts(tmp_path: Path) -> None:
    config = parse_slos(
        {
            "defaults": {"availability": 99.9, "latency": {"objective": 95, "threshold_s": 10}},
            "models": {
                "llama-3.1": {"availability": 99.5},
                "fast": {"latency": {"threshold_s": 1}},
                "same": {"availability": 99.9},
            },
        }
    )
    assert config.models["fast"].availability == 99.9 and config.models["fast"].latency_threshold_s == 1.0
    rules = slo_rules(config)
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    availability = {r["labels"]["objective"] for r in alerts if r["labels"]["slo"] == "availability"}
    assert availability == {"99.9", "99.5"}
    text = "\n".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    # RE2 needs the dot escaped, and PromQL's string the backslash.
    assert 'model!~"llama-3\\\\.1"' in text and 'model=~"llama-3\\\\.1"' in text
    assert 'le="1.0"' in text and 'le="10.0"' in text
    # "same" overrides nothing that differs: it stays under the default selector.
    assert "same" not in text
    (tmp_path / "slo.rules.yml").write_text(render_slo_rules(config))
    result = run_promtool("check", "rules", "slo.rules.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "defaults"),
        ({"defaults": {"availability": 99.9}}, "latency"),
        (
            {"defaults": {"availability": 100, "latency": {"objective": 95, "threshold_s": 10}}},
            "defaults.availability",
        ),
        (
            {"defaults": {"availability": True, "latency": {"objective": 95, "threshold_s": 10}}},
            "defaults.availability",
        ),
        ({"defaults": {"availability": 99, "latency": {"objective": 95, "threshold_s": 7}}}, "threshold_s"),
        (
            {"defaults": {"availability": 99, "latency": {"objective": 0, "threshold_s": 10}}},
            "latency.objective",
        ),
        (
            {
                "defaults": {"availability": 99, "latency": {"objective": 95, "threshold_s": 10}},
                "models": {"a b": {}},
            },
            "a b",
        ),
        (
            {
                "defaults": {"availability": 99, "latency": {"objective": 95, "threshold_s": 10}},
                "models": {"m": {"x": 1}},
            },
            "models.m",
        ),
        (
            {"defaults": {"availability": 99, "latency": {"objective": 95, "threshold_s": 10}}, "other": 1},
            "slos",
        ),
    ],
)
def test_bad_slo_configs_are_refused_naming_the_field(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_slos(data)


# -- every metric a rule reads is exported -------------------------------------------------------

_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum", ""),
    "unknown": ("",),
}


def _names(families: Any) -> set[str]:
    names = set()
    for family in families:
        for suffix in _SUFFIXES[family.type]:
            names.add(family.name + suffix)
    return names


def _vllm_names() -> set[str]:
    """vLLM's metric names and types, read from its source (importing vllm costs seconds)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vllm is not installed"
    source = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    kinds = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}
    names = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in kinds:
            for kw in node.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    names.update(kw.value.value + s for s in _SUFFIXES[kinds[node.func.attr]])
    assert "vllm:time_to_first_token_seconds_bucket" in names, "vLLM's metric definitions moved"
    return names


def _referenced(rule_files: list[Path]) -> tuple[set[str], set[str]]:
    """(raw metric names the expressions read, names the files record)."""
    raw, recorded, used = set(), set(), set()
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    recorded.add(rule["record"])
                # Label matchers and grouping clauses hold label names, not metric names.
                expr = re.sub(r"\{[^}]*\}", "", rule["expr"])
                expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
                raw |= set(re.findall(r"\b(?:paved_[a-z0-9_]+|vllm:[a-z0-9_:]+)", expr))
                used |= set(re.findall(r"\bpaved:[a-z0-9_:]+", expr))
    assert used <= recorded, f"rules read series no rule records: {sorted(used - recorded)}"
    return raw, recorded


def test_every_metric_a_rule_reads_is_exported(tmp_path: Path) -> None:
    raw, recorded = _referenced([ops_dir() / f for f in RULE_FILES])
    assert len(recorded) > 20 and len(raw) > 15

    exported = _names(GatewayMetrics().registry.collect())
    with serve_engines(SimEngine(SimConfig.from_uri("sim://tiny"))) as url:
        text = httpx.get(url + "/metrics", timeout=10).text
    exported |= _names(text_string_to_metric_families(text))

    async def control_plane() -> set[str]:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        try:
            return _names(await control_plane_families(store))
        finally:
            await store.close()

    exported |= asyncio.run(control_plane())
    exported |= _vllm_names()
    missing = sorted(raw - exported)
    assert not missing, f"rules read metrics paved does not export: {missing}"
    # The layers' anchors are all there (a regex that matched nothing would pass vacuously).
    assert {
        "paved_gateway_requests_total",
        "paved_gateway_cache_lookups_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:num_preemptions_total",
        "vllm:kv_cache_usage_perc",
        "paved_control_plane_replicas",
        "paved_control_plane_rollouts",
    } <= raw
