"""The pytest plugin tools/upstream-tests loads into upstream's pytest runs (`-p upstream_tests.plugin`).

Inert unless DS_UT_STATE is set. Then it
  * checks at session start and again after collection that `deepspeed` is imported from DS_UT_EXPECT, the
    package under test, and not from the upstream checkout or anything else on sys.path (upstream's
    tests/conftest.py puts the parent of tests/ on sys.path);
  * collect mode (DS_UT_MODE=collect): writes the selected node ids, which of them are distributed tests
    (methods of a subclass of upstream's DistributedTest/DistributedExec: they spawn one process per rank),
    the collection errors and what is under test (deepspeed, torch, GPUs) to DS_UT_STATE as JSON;
  * run mode: keeps only the node ids listed in the file DS_UT_SELECT and appends each test report to
    DS_UT_STATE as a JSON line (on the xdist controller, or the only process);
  * gives every pytest process its own master ports: upstream's tests/unit/common.py picks the port of a
    distributed test's process group with get_master_port(); once the test modules are imported, that
    function (wherever a module holds it) is replaced by master_port(), which takes the first free port of
    the xdist worker's own range, DS_UT_PORT_BASE + W * PORT_SPAN and the PORT_SPAN ports above (worker gwW;
    W = 0 without xdist). The ranges of different workers never meet, whatever the checkout's own
    get_master_port does (docs/upstream-tests.md, "Several tests at once").
"""

import json
import os
import socket
import sys

import pytest

_errors = []
_config = []
PORT_SPAN = 500  # ports per xdist worker


def worker_index(name=None):
    """W of xdist worker gwW (PYTEST_XDIST_WORKER), 0 without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "") if name is None else name
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def port_range(worker, base, span=PORT_SPAN):
    return range(base + worker * span, base + (worker + 1) * span)


def master_port(base_port=None, port_range_size=None):
    """The first port of this process's range that nothing is bound to (the arguments are upstream's, ignored)."""
    base = int(os.environ.get("DS_UT_PORT_BASE") or 20000)
    for port in port_range(worker_index(), base):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        return str(port)
    raise OSError(f"no free port in {port_range(worker_index(), base)}")


def _own_the_master_port():
    """Replace upstream's get_master_port in every loaded module that holds it (unit.common and importers)."""
    original = getattr(sys.modules.get("unit.common"), "get_master_port", None)
    if original is None:
        return 0
    patched = 0
    for module in list(sys.modules.values()):
        if getattr(module, "get_master_port", None) is original:
            module.get_master_port = master_port
            patched += 1
    return patched


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
    _own_the_master_port()
    if os.environ.get("DS_UT_MODE") == "collect":
        torch = sys.modules.get("torch")  # upstream's conftest.py imports it
        gpus = torch.cuda.device_count() if torch and torch.cuda.is_available() else 0
        info = {"deepspeed": deepspeed.__version__, "deepspeed_dir": os.path.dirname(deepspeed.__file__),
                "torch": getattr(torch, "__version__", None), "gpus": gpus,
                "gpu_name": torch.cuda.get_device_name(0) if gpus else None}
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
