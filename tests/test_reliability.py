"""Reliability claims: preemption, crashes mid-save, corrupt checkpoints, non-finite steps, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from _common import ROOT, assert_resumed_from, child_env, metrics_lines
from safetensors.torch import load_file

from effpretrain import cli
from effpretrain.config import load_config
from effpretrain.signals import REPEAT_WINDOW_S
from effpretrain.trainer import NonFiniteError, Trainer, train

RECIPE = ROOT / "recipes" / "tiny" / "adamw.yaml"
SMALL = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "train.batch_size=4",
    "train.eval_tokens=256",
    "train.log_every=1",
    "train.plot=false",
]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equal weights: used only between a run resumed after a fault and the straight run,
    which execute the same kernels in the same order with the same thread count (a child process
    inherits OMP_NUM_THREADS, `subprocess_env`)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def open_paths() -> set[str]:
    """The files this process holds open (Linux: the targets of /proc/self/fd)."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc/self/fd to see which files the process holds open")
    out = set()
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # the descriptor listdir itself used is gone
            out.add(os.readlink(fd))
    return out


def subprocess_env() -> dict[str, str]:
    return child_env(threads=None)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 30-step run, checkpoints every 10 (kept: all three)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    over = SMALL + [
        "train.max_steps=30",
        "train.save_every=10",
        "train.eval_every=30",
        "train.keep_checkpoints=3",
    ]
    summary = train(load_config(RECIPE, over), out)
    return out, over, summary


@pytest.mark.run
def test_sigterm_then_resume_auto_matches_uninterrupted(straight, tmp_path):
    ref_dir, over, _ = straight
    out = tmp_path / "run"
    args = [sys.executable, "-m", "effpretrain", "train", str(RECIPE), "--out", str(out)]
    for o in over:
        args += ["--set", o]
    proc = subprocess.Popen(
        args, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if any(json.loads(ln).get("step", 0) >= 4 for ln in lines):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = [p for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert stopped and not (out / "summary.json").exists()
    stop_step = max(int(p.name.split("-")[1]) for p in stopped)
    assert 4 <= stop_step < 30
    since = metrics_lines(out)
    train(load_config(RECIPE, over), out, resume="auto")
    assert same(weights(out, 30), weights(ref_dir, 30))  # bitwise: the same operations, in order
    assert_resumed_from(ref_dir, out, stop_step, since)


# A run whose next step (after step-2's checkpoint) or whose start-up (loading the corpus) takes
# ten minutes: what a hung step or a slow data set looks like from outside.
SLOW_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import effpretrain.data as data_mod
    from effpretrain import cli
    from effpretrain.trainer import Trainer

    where, marker, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]

    def stall():
        marker.touch()
        if where in ("native", "brief"):
            # Blocked inside one native call that no signal interrupts (as a collective whose peer
            # never comes): a default pthread mutex locked twice by its owner deadlocks. "brief"
            # gives up after a while: a slow collective that does finish, after the watchdog's
            # deadline had a signal set one.
            import ctypes
            from effpretrain.signals import FORCE_EXIT_AFTER_S

            class Timespec(ctypes.Structure):
                _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

            libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)
            libc.pthread_mutex_lock(mutex)
            if where == "brief":
                until = Timespec(int(time.time() + FORCE_EXIT_AFTER_S + 3), 0)
                libc.pthread_mutex_timedlock(mutex, ctypes.byref(until))
                return
            libc.pthread_mutex_lock(mutex)
        time.sleep(600)

    real_step, real_load = Trainer._train_step, data_mod.load_corpus

    def slow_step(self):
        if self.progress.step == 2:
            stall()
        return real_step(self)

    def slow_load(cfg):
        stall()
        return real_load(cfg)

    if where in ("step", "native", "brief"):
        Trainer._train_step = slow_step
    else:
        data_mod.load_corpus = slow_load
    sys.exit(cli.main(argv))
    """
)


def _start_slow_run(tmp_path: Path, where: str, over: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    """Starts SLOW_SCRIPT (stderr to a file) and waits until it stalls; returns (proc, marker, stderr)."""
    script, marker, err = tmp_path / "slow.py", tmp_path / "stalled", tmp_path / "stderr.txt"
    script.write_text(SLOW_SCRIPT)
    argv = ["train", str(RECIPE), "--out", str(tmp_path / "run")] + _sets(over)
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(script), where, str(marker), *argv],
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=fh,
            start_new_session=True,
        )
    _wait_for(lambda: marker.exists(), proc, err)
    return proc, marker, err


def _wait_for(cond, proc: subprocess.Popen, err: Path, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, err.read_text()[-2000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def _exit_within(proc: subprocess.Popen, seconds: float) -> int:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and any worker it started (own session)
        proc.wait()
        raise AssertionError(f"still running {seconds} s after the signal") from None


@pytest.mark.run
def test_second_sigterm_stops_a_stalled_step_at_once_without_a_checkpoint(tmp_path):
    over = SMALL + ["train.max_steps=10", "train.save_every=2", "train.eval_every=0"]
    proc, _, err = _start_slow_run(tmp_path, "step", over)
    proc.send_signal(signal.SIGTERM)
    # The first signal is handled (the run would finish the step and save) before the second comes,
    # and the second comes after the repeat window (within it, it would be the same request).
    _wait_for(lambda: "send it again to stop at once" in err.read_text(), proc, err, timeout=30)
    time.sleep(REPEAT_WINDOW_S + 0.5)
    proc.send_signal(signal.SIGTERM)
    code = _exit_within(proc, 30)  # the step would take ten minutes
    text = err.read_text()
    assert code == 128 + signal.SIGTERM, text[-2000:]
    assert "Traceback" not in text
    assert "effpretrain: stopped at once by SIGTERM (second signal); no checkpoint written" in text
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-2"]
    assert not (tmp_path / "run" / "summary.json").exists()
    records = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "event" not in r] == [1, 2]  # (memory records: "event")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stall is a glibc mutex wait")
@pytest.mark.run
def test_two_sigterms_at_once_are_one_graceful_stop(tmp_path):
    """A scheduler and a launcher may deliver two SIGTERMs together: one request, so the run
    finishes its step, saves and exits 0. The step is inside a native call when they come, so the
    handler runs once for both while the watchdog reads both: it must not count a second signal
    (it would end the process, exit 143, during the step or the save)."""
    over = SMALL + ["train.max_steps=10", "train.save_every=2", "train.eval_every=0"]
    proc, _, err = _start_slow_run(tmp_path, "brief", over)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # two deliveries (back to back, the kernel may merge them into one)
    proc.send_signal(signal.SIGTERM)
    code = _exit_within(proc, 60)
    text = err.read_text()
    assert code == 0, text[-2000:]
    assert "second signal" not in text
    assert "step-3" in {p.name for p in (tmp_path / "run" / "checkpoints").iterdir()}


def test_stop_policy_counts_this_process_signals_once_per_window():
    """Unit rules of `StopSignals`: an agreed stop (another rank's signal) does not make this
    process's own first signal a second one; a repeat within REPEAT_WINDOW_S is the same request;
    a later one stops at once."""
    from effpretrain.signals import RunInterrupted, StopSignals

    stop = StopSignals()
    stop.enter_loop()
    stop.agreed = signal.SIGTERM  # as the trainer sets it when another rank was signalled
    stop._on_signal(signal.SIGTERM, None)  # this rank's own first signal: graceful
    assert stop.requested == signal.SIGTERM
    stop._on_signal(signal.SIGTERM, None)  # delivered twice at once: still one request
    stop._last_counted -= 2.0  # a later signal
    with pytest.raises(RunInterrupted, match="second signal"):
        stop._on_signal(signal.SIGTERM, None)


@pytest.mark.run
def test_signal_right_after_a_save_does_not_rewrite_that_checkpoint(tmp_path, monkeypatch):
    """The step just saved by save_every, or just resumed from, is on disk: the graceful stop does
    not save it again (a re-save replaces the folder, which a second signal could interrupt)."""
    from effpretrain.signals import StopSignals

    saves, real_save, real_maybe, real_enter = [], Trainer.save, Trainer._maybe_save, StopSignals.enter_loop

    def counting_save(self):
        saves.append(self.progress.step)
        return real_save(self)

    def maybe_then_signal(self):
        real_maybe(self)
        if self.progress.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Trainer, "save", counting_save)
    monkeypatch.setattr(Trainer, "_maybe_save", maybe_then_signal)
    over = SMALL + ["train.max_steps=6", "train.save_every=2", "train.eval_every=0"]
    result = train(load_config(RECIPE, over), tmp_path / "run")
    assert result == {"stopped_by_signal": signal.SIGTERM, "step": 2}
    assert saves == [2]
    step2 = (tmp_path / "run" / "checkpoints" / "step-2").stat()

    def enter_then_signal(self):  # a signal before the resumed run's first step
        real_enter(self)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(StopSignals, "enter_loop", enter_then_signal)
    result = train(load_config(RECIPE, over), tmp_path / "run", resume="auto")
    assert result == {"stopped_by_signal": signal.SIGTERM, "step": 2}
    assert saves == [2]
    again = (tmp_path / "run" / "checkpoints" / "step-2").stat()
    assert (again.st_ino, again.st_mtime_ns) == (step2.st_ino, step2.st_mtime_ns)


def test_stop_signals_set_up_is_all_or_nothing(monkeypatch):
    """A watchdog that cannot start leaves no wake-up fd or pipe behind (the handlers alone apply
    the policy); a failure past that restores the previous handlers before it propagates."""
    import threading

    from effpretrain.signals import StopSignals

    def wakeup_fd() -> int:
        fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(fd)
        return fd

    before = (wakeup_fd(), open_paths(), signal.getsignal(signal.SIGTERM))

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with StopSignals() as stop:
        assert stop._watchdog is None
        assert (wakeup_fd(), open_paths()) == before[:2]
        assert signal.getsignal(signal.SIGTERM) == stop._on_signal
    assert (wakeup_fd(), open_paths(), signal.getsignal(signal.SIGTERM)) == before

    def no_pipe():
        raise MemoryError

    monkeypatch.setattr(os, "pipe", no_pipe)
    with pytest.raises(MemoryError), StopSignals():
        pass
    assert (wakeup_fd(), open_paths(), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stall is a glibc mutex deadlock")
@pytest.mark.run
def test_second_sigterm_stops_a_step_blocked_in_native_code(tmp_path):
    """Python cannot run a handler while the main thread is inside one native call: the
    watchdog, woken by the signal itself, ends the process a few seconds after the second."""
    from effpretrain.signals import FORCE_EXIT_AFTER_S

    over = SMALL + ["train.max_steps=10", "train.save_every=2", "train.eval_every=0"]
    proc, _, err = _start_slow_run(tmp_path, "native", over)
    proc.send_signal(signal.SIGTERM)
    time.sleep(REPEAT_WINDOW_S + 1)  # back to back, two signals are one request (REPEAT_WINDOW_S)
    proc.send_signal(signal.SIGTERM)
    code = _exit_within(proc, FORCE_EXIT_AFTER_S + 25)
    text = err.read_text()
    assert code == 128 + signal.SIGTERM, text[-2000:]
    assert "stopped at once by SIGTERM (second signal); no checkpoint written; blocked in native code" in text
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-2"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.run
def test_signal_during_start_up_exits_at_once_without_writing(sig, tmp_path):
    proc, _, err = _start_slow_run(tmp_path, "start-up", SMALL + ["train.max_steps=4"])
    proc.send_signal(sig)
    code = _exit_within(proc, 30)  # loading the corpus would take ten minutes
    text = err.read_text()
    assert code == 128 + sig, text[-2000:]
    assert "Traceback" not in text
    assert f"effpretrain: stopped at once by {sig.name} during start-up" in text
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


DDP_SIGNAL_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from effpretrain.config import load_config
    from effpretrain.trainer import Trainer, train

    out, recipe, over = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    rank = int(os.environ["RANK"])
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    real_step, real_save = Trainer._train_step, Trainer.save

    def step(self):
        # Rank 1 holds step 4 until the test has signalled it: rank 0 waits in step 4's all-reduce.
        if rank == 1 and self.progress.step == 3:
            (out / "held").touch()
            while not (out / "go").exists():
                time.sleep(0.05)
        return real_step(self)

    def save(self):
        # Rank 0's own SIGTERM comes late (torchrun signals every worker): after the ranks agreed
        # to stop for rank 1's, while they save. It is rank 0's first signal, so the save goes on.
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(self)

    Trainer._train_step, Trainer.save = step, save
    result = train(load_config(recipe, over), out / "run")
    (out / f"result-{rank}").write_text(repr(result))
    """
)


@pytest.mark.multiprocess
def test_sigterm_to_ddp_ranks_on_either_side_of_a_step_stops_every_rank_at_the_same_step(tmp_path):
    """A signal that reaches one rank first (the ranks on either side of a step boundary) must
    stop all of them after the same step; otherwise one saves while the other trains on and both
    wait forever in mismatched collectives. The other rank's own signal, arriving during the save,
    is its first: it does not stop that rank at once (which would leave the other hanging)."""
    from distributed_helpers import torchrun

    worker, err = tmp_path / "worker.py", tmp_path / "stderr.txt"
    worker.write_text(DDP_SIGNAL_WORKER)
    over = SMALL + ["train.max_steps=10", "train.eval_every=0", "train.batch_size=2"]
    env = child_env()
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            [*torchrun(2), str(worker), str(tmp_path), str(RECIPE), *over],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=fh,
            start_new_session=True,
        )
    _wait_for(lambda: (tmp_path / "held").exists(), proc, err)
    os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGTERM)
    _wait_for(lambda: "send it again to stop at once" in err.read_text(), proc, err, timeout=30)
    (tmp_path / "go").touch()
    code = _exit_within(proc, 120)
    assert code == 0, err.read_text()[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"result-{rank}").read_text() == "{'stopped_by_signal': 15, 'step': 4}"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-4"]


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import effpretrain.checkpoint.commit as ck
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    real_save = torch.save

    def dying_save(obj, f, *a, **kw):
        # The second checkpoint (step 20) dies after writing model and optimizer, mid-save.
        name = str(getattr(f, "name", f))  # checkpoints write through file objects
        if name.endswith("trainer.pt") and "step-20.tmp-" in name:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *a, **kw)

    ck.torch.save = dying_save
    recipe, out, *over = sys.argv[1:]
    train(load_config(recipe, over), out)
    """
)


@pytest.mark.run
def test_sigkill_mid_save_keeps_previous_checkpoint_and_resume_continues(straight, tmp_path):
    ref_dir, over, _ = straight
    out = tmp_path / "run"
    script = tmp_path / "die.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(RECIPE), str(out), *over],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "step-10" in names and "step-20" not in names
    assert any(n.startswith("step-20.tmp-") for n in names)  # the half-written folder is not a checkpoint
    since = metrics_lines(out)
    train(load_config(RECIPE, over), out, resume="auto")
    assert same(weights(out, 30), weights(ref_dir, 30))
    assert_resumed_from(ref_dir, out, 10, since)
    assert not any(".tmp-" in p.name for p in (out / "checkpoints").iterdir())


@pytest.mark.run
def test_truncated_newest_checkpoint_falls_back_to_previous(straight, tmp_path, caplog):
    ref_dir, over, _ = straight
    out = tmp_path / "run"
    shutil.copytree(ref_dir, out)
    final = weights(ref_dir, 30)
    shutil.rmtree(out / "checkpoints" / "step-30")
    (out / "summary.json").unlink()
    opt = out / "checkpoints" / "step-20" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    since = metrics_lines(out)
    with caplog.at_level("WARNING", logger="effpretrain"):
        train(load_config(RECIPE, over), out, resume="auto")
    assert any("skipping checkpoint step-20" in r.message for r in caplog.records)
    assert same(weights(out, 30), final)
    assert_resumed_from(ref_dir, out, 10, since)


@pytest.mark.run
def test_nonfinite_gradients_skip_without_advancing_and_stop_after_n(tmp_path):
    over = SMALL + [
        "train.max_steps=12",
        "train.eval_every=0",
        "train.save_every=4",
        "train.max_consecutive_skips=3",
    ]
    trainer = Trainer(load_config(RECIPE, over), tmp_path / "run")
    calls = {"n": 0}
    bad = {3, 4, 9, 10, 11}  # attempts (1-based) whose gradient the test poisons

    def poison(grad):
        return grad * float("nan") if calls["n"] in bad else grad

    def count(module, args):
        calls["n"] += 1

    model = trainer.acc.unwrap_model(trainer.model)
    model.register_forward_pre_hook(count)
    model.lm_head.weight.register_hook(poison)

    seen = {}
    real_step = trainer._train_step

    def spy():
        before = (
            trainer.progress.step,
            trainer.sched.last_epoch,
            trainer.stream.state_dict(),
            {k: v.get("step") for k, v in trainer.inner_opt.state.items()},
        )
        out = real_step()
        after = (
            trainer.progress.step,
            trainer.sched.last_epoch,
            trainer.stream.state_dict(),
            {k: v.get("step") for k, v in trainer.inner_opt.state.items()},
        )
        seen[calls["n"]] = (out[2], before, after)
        return out

    trainer._train_step = spy
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    metrics = tmp_path / "run" / "metrics.jsonl"
    with pytest.raises(NonFiniteError, match="3 consecutive non-finite steps") as stopped:
        trainer.fit()
    # The run's metrics.jsonl is closed (no descriptor of this process points at it) although the
    # traceback, held by `stopped`, keeps fit()'s frames alive; the signal handlers are back.
    assert stopped.tb is not None and str(metrics.resolve()) not in open_paths()
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers
    for attempt in (3, 4):
        finite, before, after = seen[attempt]
        assert not finite
        assert before[1] == after[1]  # scheduler did not advance
        assert all(
            torch.equal(before[2][k], after[2][k])
            if torch.is_tensor(before[2][k])
            else before[2][k] == after[2][k]
            for k in before[2]
        )  # nor the data position
        assert {k: float(v) for k, v in before[3].items()} == {k: float(v) for k, v in after[3].items()}
    assert seen[5][0] and trainer.progress.skipped == 5
    # Attempts 1,2,5,6,7,8 were good: 6 steps; the run stopped at the third skip in a row.
    assert trainer.progress.step == 6
    events = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert sum(e.get("event") == "skip" for e in events) == 5
    assert (tmp_path / "run" / "checkpoints" / "step-4").is_dir()  # the last good checkpoint is kept


# ----------------------------------------------------------------------------------------------
# Malformed inputs: each exits 2 with one line and no traceback.


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("good") / "run"
    train(load_config(RECIPE, SMALL + ["train.max_steps=2", "train.eval_every=0"]), out)
    return out / "checkpoints" / "step-2"


@pytest.mark.run
def test_sharded_resume_passes_the_weight_check_error_through_unchanged(good_ckpt, tmp_path, monkeypatch):
    """The FSDP2 resume path's weight check already names the checkpoint in one line: the sharded
    format's read does not wrap it in a second ConfigError (the path would appear twice)."""
    from effpretrain.checkpoint import load_checkpoint, sharded
    from effpretrain.checkpoint.states import ShardedFormat
    from effpretrain.errors import ConfigError

    trainer = Trainer(load_config(RECIPE, SMALL + ["train.max_steps=2", "train.eval_every=0"]), tmp_path)
    message = f"checkpoint {good_ckpt}: model weights do not match"
    state = load_checkpoint(good_ckpt)
    state["trainer"]["optimizer_skeleton"] = {}  # what an FSDP2 checkpoint's trainer.pt holds

    def mismatch(*args, **kwargs):
        raise ConfigError(message)

    monkeypatch.setattr(sharded, "load_sharded", mismatch)
    with pytest.raises(ConfigError) as caught:  # the sharded branch of a resume, as under FSDP2
        ShardedFormat(trainer.launch).read(good_ckpt, state, trainer.model, trainer.inner_opt)
    assert str(caught.value) == message


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def _copy_ckpt(src: Path, dst: Path) -> Path:
    target = dst / "run" / "checkpoints" / src.name
    shutil.copytree(src, target)
    return target


def _case_pickled_object(tmp, ckpt):
    c = _copy_ckpt(ckpt, tmp)
    with open(c / "optimizer.pt", "wb") as fh:
        pickle.dump({"state": Evil()}, fh)
    return ["train", str(RECIPE), "--out", str(tmp / "o"), "--resume", str(c)] + _sets(SMALL)


def _sharded_copy(tmp, ckpt) -> Path:
    """A copy of `ckpt` made to look like an FSDP2 (DCP) checkpoint: dcp/ instead of the files."""
    c = _copy_ckpt(ckpt, tmp)
    (c / "model.safetensors").unlink()
    (c / "optimizer.pt").unlink()
    (c / "dcp").mkdir()
    return c


def _case_dcp_pickled_metadata(tmp, ckpt):
    c = _sharded_copy(tmp, ckpt)
    with open(c / "dcp" / ".metadata", "wb") as fh:
        pickle.dump(Evil(), fh)
    return ["train", str(RECIPE), "--out", str(tmp / "o"), "--resume", str(c)] + _sets(SMALL)


def _case_dcp_bytes_entry(tmp, ckpt):
    """Real DCP metadata, but with a non-tensor entry, which DCP would unpickle without limits."""
    import torch.distributed.checkpoint as dcp

    c = _sharded_copy(tmp, ckpt)
    with warnings.catch_warnings():  # DCP: "torch.distributed is disabled ... single process"
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.zeros(2), "extra": {"payload": [1, 2]}}, checkpoint_id=str(c / "dcp"), no_dist=True
        )
    return ["export", str(c), "--out", str(tmp / "hf")]


def _case_dcp_truncated_shard(tmp, ckpt):
    """A real single-file DCP model state whose shard file is cut short."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    c = _sharded_copy(tmp, ckpt)
    weights = load_file(str(ckpt / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": weights}, checkpoint_id=str(c / "dcp"), no_dist=True)
    shard = c / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:200])
    return ["export", str(c), "--out", str(tmp / "hf")]


def _case_dcp_no_metadata(tmp, ckpt):
    c = _sharded_copy(tmp, ckpt)
    return ["export", str(c), "--out", str(tmp / "hf")]


def _case_truncated_model(tmp, ckpt):
    c = _copy_ckpt(ckpt, tmp)
    f = c / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    return ["train", str(RECIPE), "--out", str(tmp / "o"), "--resume", str(c)] + _sets(SMALL)


def _case_no_marker(tmp, ckpt):
    c = _copy_ckpt(ckpt, tmp)
    (c / "COMPLETE").unlink()
    return ["train", str(RECIPE), "--out", str(tmp / "o"), "--resume", str(c)] + _sets(SMALL)


def _case_auto_none_good(tmp, ckpt):
    c = _copy_ckpt(ckpt, tmp)
    (c / "COMPLETE").unlink()
    return ["train", str(RECIPE), "--out", str(tmp / "run"), "--resume", "auto"] + _sets(SMALL)


def _case_other_model(tmp, ckpt):
    return ["train", str(RECIPE), "--out", str(tmp / "o"), "--resume", str(ckpt)] + _sets(
        SMALL + ["model.preset=llama_20m"]
    )


def _case_other_batch(tmp, ckpt):
    return ["train", str(RECIPE), "--out", str(tmp / "o"), "--resume", str(ckpt)] + _sets(
        SMALL + ["train.batch_size=8"]
    )


def _case_existing_run(tmp, ckpt):
    c = _copy_ckpt(ckpt, tmp)
    return ["train", str(RECIPE), "--out", str(c.parent.parent)] + _sets(SMALL)


def _sets(over):
    out = []
    for o in over:
        out += ["--set", o]
    return out


def _recipe(text):
    def make(tmp, ckpt):
        p = tmp / "r.yaml"
        p.write_text(text)
        # No overrides here: a --set would mask the recipe's bad value. max_steps bounds a miss.
        return ["train", str(p), "--out", str(tmp / "o"), "--set", "train.max_steps=2"]

    return make


def _data_file(name, content, extra=()):
    def make(tmp, ckpt):
        f = tmp / "data" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            f.write_bytes(content)
        elif content is not None:
            f.write_text(content)
        path = f if content is not None else f.parent
        return ["train", str(RECIPE), "--out", str(tmp / "o")] + _sets(
            SMALL + ["data.source=files", f"data.path={path}", *extra]
        )

    return make


def _argv(*args):
    return lambda tmp, ckpt: list(args)


def _out_in_a_file(sub):
    def make(tmp, ckpt):
        (tmp / "file").write_text("not a folder")
        return ["train", str(RECIPE), "--out", str(tmp / "file" / sub), "--set", "train.max_steps=2"]

    return make


MALFORMED = {
    # recipes
    "unknown key": (_recipe("optim:\n  nam: adamw\n"), "unknown key 'optim.nam'"),
    "unknown section": (_recipe("optimiser:\n  name: adamw\n"), "unknown key 'optimiser'"),
    "wrong type": (_recipe("optim:\n  lr: fast\n"), "has the wrong type"),
    "list for scalar": (_recipe("train:\n  max_steps: [1, 2]\n"), "has the wrong type"),
    "negative lr": (_recipe("optim:\n  lr: -1.0\n"), "optim.lr=-1.0 must be > 0"),
    "zero batch": (_recipe("train:\n  batch_size: 0\n"), "train.batch_size=0 must be > 0"),
    "beta out of range": (_recipe("optim:\n  beta2: 1.0\n"), "optim.beta2=1.0 must be in [0, 1)"),
    "bad precision": (_recipe("train:\n  precision: fp8\n"), "train.precision='fp8' is not one of"),
    "bad optimizer": (_recipe("optim:\n  name: lion\n"), "optim.name='lion' is not one of"),
    "bad preset": (_recipe("model:\n  preset: gpt4\n"), "model.preset='gpt4' is not one of"),
    "bad yaml": (_recipe("optim: {name: adamw\n"), "not valid YAML"),
    "top-level list": (_recipe("- 1\n- 2\n"), "must be a mapping"),
    "hub without name": (_recipe("data:\n  source: hub\n"), "data.name is required"),
    "seq_len beyond positions": (
        _recipe("model:\n  max_position_embeddings: 16\ndata:\n  seq_len: 32\n"),
        "data.seq_len=32 exceeds model.max_position_embeddings=16",
    ),
    "rank beyond dims": (
        _recipe("optim:\n  name: galore\n  rank: 4096\n"),
        "optim.rank=4096 exceeds min(m, n)",
    ),
    "targets match nothing": (
        _recipe("optim:\n  name: galore\n  rank: 8\n  targets: [nothing]\n"),
        "matched no linear weight",
    ),
    # data
    "missing data path": (_data_file("x.txt", None, ["data.path=does/not/exist.txt"]), "data.path not found"),
    "empty txt": (_data_file("e.txt", "  \n\n "), "the corpus is empty"),
    "empty folder": (_data_file("sub/.keep", "", ["data.path=DATA"]), "no .txt, .jsonl or .parquet"),
    "jsonl without field": (_data_file("d.jsonl", '{"body": "x"}\n'), "no text field 'text'"),
    "jsonl broken": (_data_file("d.jsonl", '{"text": "x"\n'), "not valid JSON"),
    "jsonl non-string": (_data_file("d.jsonl", '{"text": 5}\n'), "is not a string"),
    "parquet garbage": (_data_file("d.parquet", b"PAR1 not really"), "not a readable parquet"),
    "csv file": (_data_file("d.csv", "text\nhello\n"), "unsupported file type"),
    "one tiny document": (_data_file("one.txt", "just one line"), "too few documents"),
    # checkpoints
    "resume missing": (
        lambda tmp, ckpt: ["train", str(RECIPE), "--resume", str(tmp / "nope")],
        "does not exist",
    ),
    "resume not a checkpoint": (
        lambda tmp, ckpt: ["train", str(RECIPE), "--out", str(tmp / "o"), "--resume", str(tmp)],
        "not a complete checkpoint",
    ),
    "pickled object": (_case_pickled_object, "optimizer.pt refused or corrupt"),
    "dcp metadata pickled object": (_case_dcp_pickled_metadata, "dcp/.metadata refused or corrupt"),
    "dcp metadata non-tensor entry": (_case_dcp_bytes_entry, "is not a tensor"),
    "dcp metadata missing": (_case_dcp_no_metadata, "dcp/.metadata is missing"),
    "dcp truncated shard": (_case_dcp_truncated_shard, "dcp/ unreadable"),
    "truncated safetensors": (_case_truncated_model, "model.safetensors unreadable"),
    "incomplete checkpoint": (_case_no_marker, "not a complete checkpoint"),
    "auto with none good": (_case_auto_none_good, "none is complete and loadable"),
    "resume other model": (_case_other_model, "resume config differs"),
    "resume other batch": (_case_other_batch, "train.batch_size: 4 -> 8"),
    "out dir holds a run": (_case_existing_run, "already holds checkpoints"),
    # CLI arguments
    "unknown command": (_argv("fly"), "invalid choice: 'fly'"),
    "estimate without model": (_argv("estimate"), "--model"),
    "estimate bad dtype": (_argv("estimate", "--model", "tiny", "--dtype", "fp8"), "invalid choice: 'fp8'"),
    "estimate negative rank": (
        _argv("estimate", "--model", "tiny", "--method", "galore", "--rank", "-4"),
        "--rank must be > 0",
    ),
    "estimate zero world": (
        _argv("estimate", "--model", "tiny", "--world-size", "0"),
        "--world-size must be > 0",
    ),
    "set without value": (_argv("train", str(RECIPE), "--set", "optim.lr"), "not of the form"),
    "out is a file": (_out_in_a_file(""), "exists and is not a directory"),
    "out below a file": (_out_in_a_file("run"), "file is not a writable directory"),
    "set non-number": (
        _argv("train", str(RECIPE), "--set", "train.seed=abc"),
        "train.seed='abc' has the wrong type",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
@pytest.mark.run
def test_malformed_input_exits_2_one_line(case, tmp_path, good_ckpt, capsys):
    make, needle = MALFORMED[case]
    argv = make(tmp_path, good_ckpt)
    argv = [a.replace("data.path=DATA", f"data.path={tmp_path / 'data' / 'sub'}") for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "it/s]" not in ln]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert needle in lines[0], lines[0]


def test_at_least_thirty_malformed_cases():
    assert len(MALFORMED) >= 30
