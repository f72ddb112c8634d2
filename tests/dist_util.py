"""Run a function on N real processes joined by a gloo process group on CPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta

import torch

from flexdemo.tools.ranks import free_port
from flexdemo.transport.inprocess import InProcessTransport

_CTX = mp.get_context("forkserver")
# what every rank imports, imported once in the fork server: a rank then starts without the
# second or two of CPU that torch.distributed.tensor (with sympy), FSDP and flexdemo cost it
# (tests/test_agreement.py: 107 s -> 44 s on the 2-core machine under load); torch._dynamo
# too, which every torch optimizer imports when it is built (add_param_group is wrapped in
# torch._disable_dynamo): 0.7 s of CPU in each rank that steps an optimizer; and DCP, which
# flexdemo imports only to save or load
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp",
                             "torch.distributed.tensor", "torch._dynamo",
                             "torch.distributed.checkpoint", "flexdemo"])


def spawn_ranks(world: int, args: list[str], timeout: float = 30,
                ranks: list[int] | None = None, port: int | None = None,
                env: dict | None = None) -> list[Forked]:
    """``world`` bare processes of ``python -m flexdemo ARGS`` with torchrun's variables, one
    rank per launcher (``LOCAL_WORLD_SIZE=1``), collectives timing out after ``timeout`` s;
    stdout and stderr together, what ``communicate()`` returns. ``ranks``: start only these
    (a job whose other ranks never arrive); ``env``: more variables. Each is forked from the
    fork server (:class:`Forked`: a real process, without 4 s of imports)."""
    port = port or free_port()
    procs = []
    for rank in range(world) if ranks is None else ranks:
        env_r = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world),
                     LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     OMP_NUM_THREADS="1", FLEXDEMO_TIMEOUT=str(timeout))
        env_r.update(env or {})
        procs.append(Forked(["-m", "flexdemo", *args], env=env_r))
    return procs


def kill_and_hear(procs: list, killed: int, timeout: float = 120) -> dict[int, str]:
    """SIGKILL rank ``killed`` of ``procs`` and return each survivor's output once it has
    stopped (a hang guard of ``timeout`` s, not a speed test), after checking that each
    stopped with exit code 1 and one ``flexdemo train: error`` line naming ``rank R: lost
    rank KILLED`` (no C++ frames, no traceback)."""
    import signal

    procs[killed].send_signal(signal.SIGKILL)
    outputs = {r: p.communicate(timeout=timeout)[0] for r, p in enumerate(procs) if r != killed}
    for rank, text in outputs.items():
        assert procs[rank].returncode == 1, (rank, text[-2000:])
        errors = [line for line in text.splitlines() if "flexdemo train: error" in line]
        assert len(errors) == 1, (rank, text[-3000:])
        assert f"rank {rank}: lost rank {killed} " in errors[0], (rank, errors[0])
        assert "frame #" not in errors[0] and ".cpp" not in errors[0], errors[0]
        assert "Traceback" not in text, (rank, text[-3000:])
    return outputs


def reap(procs: list) -> None:
    """Kill and wait for every process of ``procs`` still running (a test's clean-up)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


# ------------------------------------------------------------------ `python ...` forked
# A test that starts `python -m MODULE ...`, `python -c CODE` or `python SCRIPT` pays its
# interpreter's start-up and imports (about 4 s of CPU with torch and flexdemo) in every
# process. `Forked` runs the same command line in a process forked from the fork server above
# instead, which has them imported: a real process all the same (its own pid, exit status,
# environment, working folder and output files; a SIGKILL kills it, a SIGKILL it sends itself
# ends it with -9, a SIGTERM reaches its handlers), and what the command runs it runs from the
# start, as the fresh interpreter would (`runpy`, or the code as __main__), then the
# interpreter's exit (its threads joined, its atexit functions). What differs is what no test
# that uses it reads: the modules the server preloaded are already imported (torch's thread
# count is set from OMP_NUM_THREADS as a fresh interpreter reads it at torch's import), and
# sys.path (the command's entry first, then the pytest process's), the signal dispositions and
# sys.flags are the server's. A test about a fresh interpreter itself (what an import does, a
# variable read at import, a script alone in a folder) starts a real one.


class Forked:
    """``python ARGS`` (``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...``) in a process
    forked from the fork server, with subprocess.Popen's ``pid``, ``args``, ``returncode``,
    ``poll``, ``wait``, ``communicate``, ``kill``, ``terminate`` and ``send_signal``. ``env``:
    its whole environment (as Popen's); ``cwd``: its working folder; ``stdout``, ``stderr``:
    the file each goes to (created empty here, before it starts), or ``subprocess.PIPE``: a
    file of its own, whose text :meth:`communicate` returns; ``stderr=subprocess.STDOUT``
    (the default): stdout's file."""

    def __init__(self, args: list[str], *, stdout: str | os.PathLike | int = subprocess.PIPE,
                 stderr: str | os.PathLike | int = subprocess.STDOUT, env: dict | None = None,
                 cwd: str | os.PathLike | None = None) -> None:
        if not args or (args[0] in ("-m", "-c") and len(args) < 2) or (
                args[0].startswith("-") and args[0] not in ("-m", "-c")):
            raise ValueError(f"Forked runs `python -m MODULE ...`, `python -c CODE ...` or "
                             f"`python SCRIPT ...`, not {args}")
        self.args = [sys.executable, *args]
        self._scratch = None
        if subprocess.PIPE in (stdout, stderr):
            self._scratch = tempfile.TemporaryDirectory(prefix="forked-")
        self._outs = [self._file(stdout, "stdout")]
        if stderr != subprocess.STDOUT:
            self._outs.append(self._file(stderr, "stderr"))
        for path in self._outs:
            open(path, "wb").close()
        self._proc = _CTX.Process(target=_as_python, name=" ".join(args[:2]),
                                  args=(list(args), dict(os.environ if env is None else env),
                                        None if cwd is None else str(cwd), self._outs))
        self._proc.start()
        self.pid = self._proc.pid

    def _file(self, where: str | os.PathLike | int, name: str) -> str:
        if where == subprocess.PIPE:
            assert self._scratch is not None
            return os.path.join(self._scratch.name, name)
        if isinstance(where, int):
            raise ValueError(f"Forked writes to files or subprocess.PIPE, not {where}")
        return str(where)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Wait for it to end (after ``timeout`` s TimeoutExpired, as Popen's, and it runs
        on), then its output: stdout's text, and stderr's (None when it went to stdout)."""
        self.wait(timeout)
        texts = []
        for path in self._outs:
            with open(path, errors="replace") as f:
                texts.append(f.read())
        return texts[0], texts[1] if len(texts) > 1 else None

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def run_python(args: list[str], *, timeout: float, env: dict | None = None,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *args], capture_output=True, text=True, ...) with
    :class:`Forked`; killed, and TimeoutExpired raised, after ``timeout`` s."""
    p = Forked(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    try:
        out, err = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    return subprocess.CompletedProcess(p.args, p.wait(), out, err)


def _as_python(args: list[str], env: dict, cwd: str | None, outs: list[str]) -> None:
    """In the forked process: become ``python ARGS`` (see :class:`Forked`)."""
    import atexit
    import runpy
    import threading
    import types

    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    fds = [os.open(path, os.O_WRONLY | os.O_APPEND) for path in outs]
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)
    for fd in fds:
        os.close(fd)
    if "OMP_NUM_THREADS" in env:  # what torch read at its import in a fresh interpreter
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # (runpy puts the module's file first)
            sys.path.insert(0, os.getcwd())
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path.insert(0, "")
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:  # a script: its folder first on the path (runpy puts it first in argv)
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.realpath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # the interpreter's report of an uncaught exception, exit status 1
        kind, error, tb = sys.exc_info()
        sys.excepthook(kind, error, tb.tb_next if tb is not None else None)  # (not this frame)
        code = 1
    # the interpreter's exit: its threads' exit (executors told to stop, the other non-daemon
    # threads joined), then its atexit functions
    threading._shutdown()
    atexit._run_exitfuncs()
    raise SystemExit(code)


def run_as_torchrun(script, world: int, cwd, timeout: float = 120) -> list[str]:
    """``script`` on ``world`` forked processes with torchrun's variables (one node, a free
    port on loopback); every one must exit 0. Their outputs, by rank."""
    port = free_port()
    procs = [Forked([str(script)], cwd=cwd, env=dict(
        os.environ, RANK=str(r), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        FLEXDEMO_TIMEOUT="60")) for r in range(world)]
    try:
        outs = [p.communicate(timeout)[0] for p in procs]
    finally:
        reap(procs)
    assert [p.returncode for p in procs] == [0] * world, outs
    return outs


def _entry(fn, rank, world, port, outdir, args, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world: int, *args, timeout: float = 240, env: dict | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return their results by rank.

    Raises ``AssertionError`` with the workers' tracebacks if any of them failed or hung.
    """
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        procs = [_CTX.Process(target=_entry, args=(fn, r, world, port, outdir, args, env or {}))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.err")
            if os.path.exists(path):
                errors.append(f"--- rank {r} ---\n" + open(path).read())
        if hung or errors:
            raise AssertionError(f"hung ranks: {hung}\n" + "\n".join(errors))
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)
                for r in range(world)]


def replicas_by_shard(results: list, name: str) -> dict:
    """The per-rank results of entry ``name`` grouped by shard coordinate: each group holds
    the replicas of one shard (results carry the rank's mesh ``coord``)."""
    groups: dict = {}
    for res in results:
        groups.setdefault(res[name]["coord"][1], []).append(res[name])
    return groups


def corrupt_first_values(rep, dtype: torch.dtype, count: int) -> None:
    """Make DeMo replicator ``rep`` send NaN as the first ``count`` values (of ``dtype``) of its
    first group from now on: a corrupt peer."""
    fill = rep.encode_payload

    def corrupt(grads, lrs, step, buf):
        res = fill(grads, lrs, step, buf)
        g = rep.groups[0]
        buf[g.val_off: g.val_off + count * dtype.itemsize].view(dtype).fill_(float("nan"))
        return res

    rep.encode_payload = corrupt


# ---------------------------------------------------------------------- in-process replicas
class _Done:
    """A collective's handle: complete when launched."""

    def wait(self) -> bool:
        return True


class RankOrder(InProcessTransport):
    """Replica ``rank`` of a hub whose all-reduce adds the replicas' tensors in rank order
    (``((x0 + x1) + x2)`` wherever a value sits), so that a dense reference can sum alike."""

    def all_reduce_sum_(self, buf, async_op=False):
        def rank_order(parts):
            total = parts[0].reshape(-1).clone()
            for p in parts[1:]:
                total += p.reshape(-1)
            return total

        buf.copy_(self.hub.collective(self.rank, "all_reduce", buf, rank_order).view_as(buf))
        return _Done() if async_op else None


def alike(build):
    """A factory of ``build()``'s model with the same initial parameters every call: drawn
    once under seed 0 (without touching torch's generator) and loaded, since replicas in
    threads share that generator and none can draw from a seed of its own."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = build().state_dict()

    def model_fn():
        net = build()
        net.load_state_dict(state)
        return net
    return model_fn


def outer_sync(glob: list, models: list, means: list | None, outer) -> None:
    """A dense DiLoCo reference's sync: the outer step on the mean pseudo-gradients
    ``means`` (none: a sync dropped, no outer step), then every replica restarted from the
    global parameters ``glob``."""
    with torch.no_grad():
        if means is not None:
            for g, avg in zip(glob, means):
                g.grad = avg
            outer.step()
            outer.zero_grad()
        for m in models:
            for p, g in zip(m.parameters(), glob):
                p.copy_(g)
