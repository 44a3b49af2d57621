import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # forkbuild (the build pipeline) is tested from the checkout; deepspeed never is
# Inductor on a CPU checks each vector instruction set the CPU reports by building a library and loading it in a
# new Python process (torch imported again: about 2 s of CPU), in every process that compiles: some 36 processes of the
# suite's 2-core run. The suite trusts the CPU's report instead (the processes it starts inherit this); the code
# Inductor generates is the same.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# The order tests are handed out in (tools/run-tests spreads them over pytest-xdist workers, in this order: its
# --no-loadscope-reorder). test_arch_list.py first, as one unit: it imports deepspeed's CUDA op builders into the
# pytest process, which no test may have done with another accelerator before it (the accelerator deepspeed picks
# stays the process's). Then the longest ones, so that none is left running alone at the end. Order only: every test
# still runs; the rest keep theirs.
FIRST = ("tests/test_arch_list.py::", "tests/test_compile_check.py::test_deepcompile_op_builds",
         "tests/test_bench_tool.py::", "tests/test_zero_diff.py::", "tests/test_checkpoints_cross_versions.py::",
         "tests/test_checkpoint_writer_round_trip.py::", "tests/test_compile_check.py::",
         "tests/test_bench_trainer_tool.py::", "tests/test_model_zoo_subsets.py::")
ONE_UNIT = ("tests/test_arch_list.py", )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups marked here
def pytest_collection_modifyitems(config, items):
    """Orders the tests (FIRST), and keeps each module whose tests share a module-scoped fixture of its own on one
    xdist worker (`--dist loadgroup`): split between workers, such a fixture (two ranks training, say) would run once
    on each."""
    def rank(item):
        return next((i for i, prefix in enumerate(FIRST) if item.nodeid.startswith(prefix)), len(FIRST))

    items.sort(key=rank)  # stable: the rest keep their order
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("xdist_group"):
            continue
        module = item.nodeid.split("::")[0]
        if module in ONE_UNIT or any(
                defs and defs[-1].scope in ("module", "class") and str(defs[-1].baseid).split("::")[0] == module
                for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(module))


@pytest.fixture(scope="session", autouse=True)
def warm_python(tmp_path_factory):
    """This pytest process's warm interpreters (tests/warm_python.py): the workers the tests start through
    tests/cpu_worker.py and tests/gpu/dist.py are forks of them, torch, deepspeed and transformers imported already,
    wherever the fork is the process they would have started (otherwise they start cold). Each server's log (its
    socket's path + ".log") says which ran warm. Without deepspeed, or with FORK_TESTS_COLD=1, there is none; the
    first server is yielded."""
    import subprocess

    import warm_python as warm
    from cpu_worker import cpu_env
    if importlib.util.find_spec("deepspeed") is None or os.environ.get("FORK_TESTS_COLD"):
        yield None
        return
    folder = tmp_path_factory.mktemp("warm")
    path = str(folder / "s")
    servers = []
    for k in range(warm.RANK_SERVERS):  # server k > 0 for torchrun's ranks only (warm.server_path)
        socket_path = warm.server_socket(path, k)
        with open(socket_path + ".log", "w") as log:
            servers.append(subprocess.Popen([sys.executable, warm.CLIENT, "--serve", socket_path], env=cpu_env(),
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    os.environ[warm.SOCKET_ENV] = path  # used once the server listens (warm.python_command)
    try:
        yield servers[0]
    finally:
        os.environ.pop(warm.SOCKET_ENV, None)
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()


@pytest.fixture(scope="session")
def repo_root():
    return REPO


@pytest.fixture(scope="session")
def pin():
    from forkbuild import pin as pin_mod
    return pin_mod.load(REPO)


@pytest.fixture(scope="session")
def fork_wheel():
    """The wheel tools/run-tests built and installed; tests of deepspeed run against that install."""
    path = os.environ.get("FORK_WHEEL")
    if not path or not os.path.isfile(path):
        pytest.fail("FORK_WHEEL is not set: run the suite with tools/run-tests, which builds and installs the wheel")
    return path


@pytest.fixture(scope="session")
def pinned_upstream_site(pin):
    """Upstream's pinned release (tools/pinned_upstream.site: the sdist the fork's build verifies, `pip install
    --target`), kept in the test environment under the sdist's sha256 and the torch it was built beside, and built
    there once: every module, xdist worker and later run of this environment uses that one build (and the ops
    deepspeed JIT-builds for it, whose folders tests name after the site's path). A process that finds another
    building it waits for that build."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: 0.19.8 is compared with the installed fork")
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import pinned_upstream
    root = os.path.join(sys.prefix, "pinned-upstream")
    site = os.path.join(root, f"{pin.sha256[:16]}-torch{importlib.metadata.version('torch')}", f"site-{pin.version}")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.isdir(os.path.join(site, "deepspeed")):
                # Built aside and moved in whole: a build cut short leaves no site that looks complete.
                staging = tempfile.mkdtemp(dir=root)
                try:
                    built = pinned_upstream.site(staging, pin.version)
                    shutil.rmtree(site, ignore_errors=True)
                    os.makedirs(os.path.dirname(site), exist_ok=True)
                    os.rename(built, site)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
            return site
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
