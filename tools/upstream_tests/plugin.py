"""The pytest plugin tools/upstream-tests loads into upstream's pytest runs (`-p upstream_tests.plugin`).

Inert unless DS_UT_STATE is set. Then it
  * checks at session start and again after collection that `deepspeed` is imported from DS_UT_EXPECT, the
    package under test, and not from the upstream checkout or anything else on sys.path (upstream's
    tests/conftest.py puts the parent of tests/ on sys.path);
  * collect mode (DS_UT_MODE=collect): writes the selected node ids, which of them are distributed tests
    (methods of a subclass of upstream's DistributedTest/DistributedExec: they spawn one process per rank),
    the collection errors and what is under test (deepspeed, torch, GPUs) to DS_UT_STATE as JSON;
  * run mode: keeps only the node ids listed in the file DS_UT_SELECT and appends each test report to
    DS_UT_STATE as a JSON line (on the xdist controller, or the only process).
"""

import json
import os
import sys

import pytest

_errors = []
_config = []


def _on():
    return bool(os.environ.get("DS_UT_STATE"))


def _check_deepspeed():
    import deepspeed
    found = os.path.dirname(os.path.realpath(deepspeed.__file__))
    expected = os.environ["DS_UT_EXPECT"]
    if found != expected:
        raise pytest.UsageError(f"upstream-tests: deepspeed is imported from {found}, not from the package under "
                                f"test {expected}: something on sys.path shadows it")
    return deepspeed


def pytest_configure(config):
    _config.append(config)


def pytest_sessionstart(session):
    if _on():
        _check_deepspeed()


def pytest_collectreport(report):
    if _on() and report.failed:
        _errors.append({"nodeid": report.nodeid, "message": _message(report)})


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not _on() or os.environ.get("DS_UT_MODE") != "run":
        return
    with open(os.environ["DS_UT_SELECT"]) as f:
        wanted = set(line.rstrip("\n") for line in f)
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
    items[:] = [i for i in items if i.nodeid in wanted]


def pytest_collection_finish(session):
    if not _on():
        return
    deepspeed = _check_deepspeed()
    if os.environ.get("DS_UT_MODE") == "collect":
        torch = sys.modules.get("torch")  # upstream's conftest.py imports it
        info = {"deepspeed": deepspeed.__version__, "deepspeed_dir": os.path.dirname(deepspeed.__file__),
                "torch": getattr(torch, "__version__", None),
                "gpus": torch.cuda.device_count() if torch and torch.cuda.is_available() else 0}
        with open(os.environ["DS_UT_STATE"], "w") as f:
            items = [i.nodeid for i in session.items]
            distributed = [i.nodeid for i in session.items if _distributed(i)]
            json.dump({"items": items, "distributed": distributed, "errors": _errors, "info": info}, f)


def _distributed(item):
    cls = getattr(item, "cls", None)
    return cls is not None and any(c.__name__ in ("DistributedTest", "DistributedExec") for c in cls.__mro__)


def pytest_runtest_logreport(report):
    if not _on() or os.environ.get("DS_UT_MODE") != "run" or hasattr(_config[0], "workerinput"):
        return
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
              "xfail": hasattr(report, "wasxfail"), "seconds": report.duration, "message": _message(report)}
    if report.failed:
        record["longrepr"] = report.longreprtext[-4000:]
    with open(os.environ["DS_UT_STATE"], "a") as f:
        f.write(json.dumps(record) + "\n")


def _message(report):
    """One line saying why a test did not pass: the skip reason, or the exception line of a failure."""
    if report.passed:
        return ""
    if isinstance(report.longrepr, tuple):  # a skip: (path, lineno, reason)
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.splitlines()[0][:500]
    lines = [line for line in report.longreprtext.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[-1][:500]
