"""A warm Python for the suite's worker processes: torch, deepspeed and transformers imported once, each worker a fork.

Most of the suite's processes are workers that import torch, deepspeed and often transformers before doing a few
seconds of work: on a 2-core host the imports alone take about 7 s of CPU a process. tests/conftest.py starts servers
per pytest process (`python tests/warm_python.py --serve SOCKET`, DeepSpeed's CPU accelerator), which import them
and wait. A worker is then started as `python tests/warm_python.py ARGS...` in place of `python ARGS...`
(tests/cpu_worker.py, tests/gpu/dist.py: `python_command()`; torchrun's ranks: `torchrun_command()`): this client
hands a server its arguments, environment, working directory and standard streams; the server forks, and the fork
runs the script, `-c` code or `-m` module as the interpreter would have, as `__main__`, then exits with its status,
which the client exits with. Signals the client gets go to the fork; a client killed (a test's timeout) takes the fork
and its processes with it. The ranks of one torchrun job are forks of different servers (RANK_SERVERS), so they
hash strings differently, as cold ranks do; each fork's random numbers are its own, as a cold process's are.

The fork is the process the command would have started only where nothing it inherits could differ, so anything else
runs cold (the client execs the interpreter itself, the command unchanged):
- an interpreter option other than -u, -c and -m;
- an environment variable read when the preloaded modules are imported, set otherwise than in the server's (the
  accelerator, PYTHONPATH, torch's and Inductor's settings, the temporary folder...): READ_AT_IMPORT, less the ones
  read only when used (READ_WHEN_USED);
- a server that had started a thread by the time it had imported everything (a fork keeps only the forking thread).
FORK_TESTS_COLD=1 runs the whole suite cold.
"""

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "FORK_TESTS_WARM_PYTHON"
CLIENT = os.path.abspath(__file__)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.elastic.agent.server.local_elastic_agent", "torch._dynamo",
           "torch._inductor.compile_fx", "deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3",
           "transformers", "transformers.modeling_utils", "transformers.trainer")
READ_AT_IMPORT = ("TORCH", "PYTORCH", "DS_", "CUDA", "NCCL", "OMP_", "MKL", "KMP_", "GOMP", "TRANSFORMERS", "HF_",
                  "TOKENIZERS", "PYTHON", "LD_", "TRITON", "TMP", "TEMP", "ACCELERATE", "NVIDIA", "XDG_", "HOME",
                  "LANG", "LC_")
# Names, or prefixes: TORCHELASTIC_ are torchrun's settings for its ranks, which no module reads when imported.
READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
                  "PYTHONUNBUFFERED", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_")
# Servers a pytest process keeps: torchrun's ranks alternate between them by local rank, so that two ranks of a job
# hash strings differently, as two cold interpreters do.
RANK_SERVERS = 2


def python_command():
    """The start of a command that runs Python code (then: a script and its arguments, -c CODE, -m MODULE): the warm
    client where this process has a server, else the interpreter."""
    path = os.environ.get(SOCKET_ENV)
    if path and os.path.exists(path) and not os.environ.get("FORK_TESTS_COLD"):  # it appears once the server listens
        return [sys.executable, CLIENT]
    return [sys.executable]


def torchrun_command(*launcher_args):
    """The start of a torchrun command (then: the script and its arguments) with torchrun's options: where this
    process has a server, torchrun is a fork of it and starts each rank as the warm client (--no-python, the
    interpreter's -u as torchrun gives it), so the ranks are forks too."""
    start = python_command()
    command = [*start, "-m", "torch.distributed.run", *launcher_args]
    if len(start) == 1:
        return command
    return [*command, "--no-python", sys.executable, CLIENT, "-u"]


def server_socket(path, k):
    """Where server k of those whose first listens at `path` listens."""
    return path + (f".{k}" if k else "")


def server_path(env):
    """The socket of the server a client with environment `env` asks: a rank's by its local rank (RANK_SERVERS)."""
    local_rank = env.get("LOCAL_RANK", "0")
    k = int(local_rank) % RANK_SERVERS if local_rank.isdigit() else 0
    return server_socket(env[SOCKET_ENV], k)


def parse(argv):
    """(how, target, arguments, unbuffered) of an interpreter command's arguments, how one of "script", "code",
    "module"; None where an option asks for something a warm fork does not do."""
    unbuffered = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-u":
            unbuffered = True
        elif arg in ("-c", "-m") and i + 1 < len(argv):
            return ("code" if arg == "-c" else "module"), argv[i + 1], argv[i + 2:], unbuffered
        elif arg.startswith("-"):
            return None
        else:
            return "script", arg, argv[i + 1:], unbuffered
        i += 1
    return None


def differs_at_import(env, server_env, set_by_imports):
    """The variables of `env` read at import that the server's environment had otherwise when it started; one that the
    imports set (as they would in a cold process) differs only where `env` has another value."""
    def differs(name):
        if env.get(name) == server_env.get(name):
            return False
        return name not in set_by_imports or env.get(name, set_by_imports[name]) != set_by_imports[name]

    return sorted(n for n in set(env) | set(server_env)
                  if n.startswith(READ_AT_IMPORT) and not n.startswith(READ_WHEN_USED) and differs(n))


# The client.


def _read_line(conn):
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def client(argv):
    cold = [sys.executable, *argv]
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(server_path(os.environ))
        payload = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(payload))], [0, 1, 2])
        conn.sendall(payload)
        started = _read_line(conn)
    except OSError:
        started = None
    if not started or "pid" not in started:
        os.execv(sys.executable, cold)
    pid = started["pid"]

    def forward(sig, frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    ended = _read_line(conn)
    code = 1 if ended is None else ended["exit"]
    if code < 0:  # killed by a signal: so is the client
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# The server.


def _run(request, set_by_imports, how, target, args, unbuffered):
    """In the fork: become the process the command would have started, run it, exit with its status."""
    import atexit
    import runpy
    import threading
    import traceback
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in set_by_imports.items():
        os.environ.setdefault(name, value)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # numpy's global generator, seeded from the OS when imported: each process its own, as cold (random's reseeds
    # itself in a fork).
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if unbuffered or request["env"].get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    code = 0
    try:
        if how == "script":
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        elif how == "code":
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: B036 -- the interpreter prints it and exits with 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # as the interpreter does at exit: wait for the threads that are not daemons
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(path):
    import importlib
    import selectors
    import threading

    server_env = dict(os.environ)  # what a cold process starts with
    for name in PRELOAD:
        importlib.import_module(name)
    forkable = threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
    # What the imports set in the environment (torch: PYTORCH_NVML_BASED_CUDA_CHECK), as a cold process's would.
    set_by_imports = {name: value for name, value in os.environ.items() if server_env.get(name) != value}
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    running = {}  # fork's pid: its client's connection, registered in the selector with the pid as its data
    sys.stdout.flush()
    sys.stderr.flush()
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.2):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    header, fds, _, _ = socket.recv_fds(conn, 4, 3)
                    size, = struct.unpack("!I", header)
                    payload = b""
                    while len(payload) < size:
                        chunk = conn.recv(size - len(payload))
                        if not chunk:
                            raise OSError("client gone")
                        payload += chunk
                    request = json.loads(payload)
                except (OSError, ValueError, struct.error):
                    conn.close()
                    continue
                parsed = parse(request["argv"])
                differs = differs_at_import(request["env"], server_env, set_by_imports)
                command = " ".join(request["argv"])[:160].replace("\n", " ")
                if not forkable or parsed is None or len(fds) != 3 or differs:
                    print(f"cold ({'threads' if not forkable else differs or 'options'}): {command}", flush=True)
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(b'{"cold": true}\n')
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    os.setpgid(0, 0)
                    selector.close()
                    listener.close()
                    for other in running.values():
                        other.close()
                    conn.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                    for fd in fds:
                        if fd > 2:
                            os.close(fd)
                    _run(request, set_by_imports, *parsed)
                for fd in fds:
                    os.close(fd)
                print(f"warm {pid}: {command}", flush=True)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                running[pid] = conn
                selector.register(conn, selectors.EVENT_READ, data=pid)
            elif not key.fileobj.recv(1):  # a client's connection at its end: the client is gone, so goes its fork
                try:
                    os.killpg(key.data, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                selector.unregister(key.fileobj)
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is None:
                continue
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:  # the client is gone
                pass
            if conn in selector.get_map():
                selector.unregister(conn)
            conn.close()
    for pid in running:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
