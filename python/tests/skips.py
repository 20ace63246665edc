"""Capability skips, as the Rust tests' `oogc_swapper::skip`: a test that cannot run a part here
says so by name and is counted, and a required capability fails instead.

`skip(capability, test, why)` appends `<test>: skipped (<capability>): <why>` to the file named by
`OOGC_SKIP_LOG` (CI prints and checks it; pytest's `-rs` summary lists the same reasons) and
skips; where `OOGC_REQUIRE` (comma-separated names, or `all`) names the capability it fails
instead. `need(module, why)` imports a module or skips with capability `python` (a Python
dependency: CI requires them all).
"""

import importlib
import os

import pytest


def required(capability: str) -> bool:
    """Whether `OOGC_REQUIRE` names `capability` (or `all`)."""
    names = (n.strip() for n in os.environ.get("OOGC_REQUIRE", "").split(","))
    return any(n in ("all", capability) for n in names)


def skip(capability: str, test: str, why: str):
    """Skips `test` for want of `capability` (module level too), or fails where it is required."""
    if required(capability):
        pytest.fail(f"{test}: {capability} is required (OOGC_REQUIRE) but unavailable: {why}", pytrace=False)
    line = f"{test}: skipped ({capability}): {why}\n"
    log = os.environ.get("OOGC_SKIP_LOG")
    if log:
        with open(log, "a") as f:
            f.write(line)
    pytest.skip(f"({capability}) {why}", allow_module_level=True)


def need(module: str, test: str, why: str):
    """`module` imported, or `test` skipped (capability `python`) saying it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        skip("python", test, f"{module} is not installed ({why}): {e}")
