"""The out-of-tree provider, live, through vLLM's plugin loader and dispatch:
loaded quietly, the CPU kernels called eager by the route it logs, within the
kernels' bound of native, and none when compiling (native, which Inductor fuses)."""

import logging
import sys
from importlib.metadata import entry_points
from logging.handlers import BufferingHandler

import pytest
from calls import BF16_RTOL, COUNT_MODES, count


@pytest.fixture(scope="session")
def plugin_log():
    """(level, message) of each line the plugins logged as vLLM loaded them."""
    import vllm.logger  # noqa: F401  (configures vLLM's loggers, handlers included)
    from vllm.plugins import load_general_plugins

    handler, logger = BufferingHandler(capacity=1 << 20), logging.getLogger("vllm")
    level = logger.level  # 0.31 on configures its level lazily: see INFO now
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        load_general_plugins()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    ours = [r for r in handler.buffer if r.name.startswith("vllm.plugins.")]
    return [(r.levelname, r.getMessage()) for r in ours]


@pytest.fixture(scope="session")
def counted(plugin_log, fact):
    results = {mode: count(mode) for mode in COUNT_MODES}
    fact("provider", {m: r["calls"] for m, r in results.items()})
    fact("route", results["eager"]["route"])
    return results


def test_plugin_loads_quietly(plugin_log):
    """vLLM's loader ran the project's entry point, which logged no warning."""
    plugins = entry_points(group="vllm.general_plugins")
    ours = [e for e in plugins if e.dist and e.dist.name == "vllm-patch"]
    assert ours, "no vllm.general_plugins entry point of vllm-patch"
    assert ours[0].module in sys.modules, f"{ours[0]} was not loaded"
    loud = [m for level, m in plugin_log if level not in ("DEBUG", "INFO")]
    assert not loud, loud[0]


def test_eager_calls_what_the_rule_says(counted):
    """Each kernel runs eager exactly where the rule expects it."""
    assert not counted["eager"]["unexpected"], counted["eager"]["described"]


def test_route_logged(counted, plugin_log):
    """The provider names in vLLM's log the route vLLM took."""
    took = counted["eager"]["route"]
    said = [m for _, m in plugin_log if "route" in m.lower()]
    assert said, f"no log line names the route ({took} taken): {plugin_log}"
    assert took in said[0], f"{took} taken, logged: {said[0]}"


def test_eager_numerics(counted):
    rtol = counted["eager"]["rtol_needed"]
    assert rtol <= BF16_RTOL, f"rtol {rtol:.3g} needed against native"


def test_compiled_calls_no_kernel(counted):
    compiled = counted["compiled"]
    assert compiled["compilation_mode"] != 0, compiled["described"]
    assert not compiled["unexpected"], compiled["described"]
