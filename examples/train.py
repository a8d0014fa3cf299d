"""Train a small GPT on 4 local procs under the plan auto_plan picks, from one controller.

The controller profiles the model here, lets ``auto_plan`` compare every
dp/fsdp/tp/pp split of the procs and prints why it chose one, spawns one
trainer actor per proc under that plan (with its pipeline stage boundaries),
and trains on synthetic tokens that follow a hidden rule, so the loss falls.
The data is read on the ranks (each data-parallel rank makes its own share
of every batch from a factory; a step call carries no data), and each step
returns its figures: loss, gradient norm, learning rate, tokens/s, MFU
against a matmul peak measured on the ranks, and peak memory per rank.

Run:
    python examples/train.py                        # auto_plan chooses
    python examples/train.py --plan dp=2,tp=2       # or name the plan yourself
    python examples/train.py --memory-mib 3         # a memory limit per rank changes the choice
    python examples/train.py --steps 100 --save /tmp/gpt-ckpt
    python examples/train.py --max-grad-norm 1 --warmup 5 --precision bf16 --accum 2

Ctrl-C stops the step loop and shuts the trainer and procs down (exit 130); a
second Ctrl-C exits at once (the procs die with this process). A rank that
fails ends the run with exit 1 and a message naming it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

# One intra-op thread per proc: four procs sharing a few cores run faster
# without oversubscription. The procs inherit this environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402

import actormesh.actor as am  # noqa: E402
from actormesh.actor import ActorError, MeshFailure, SupervisionError, this_host  # noqa: E402
from actormesh.parallel import LRSchedule, Plan, PlanError, StepFigures, TrainOptions, auto_plan, spawn_trainer  # noqa: E402
from actormesh.parallel.models import gpt, lm_loss  # noqa: E402

VOCAB, SEQ_LEN = 64, 32
STOP_TIMEOUT_S = 15.0
#: Bootstrap of every proc: only the controller handles Ctrl-C (a terminal sends
#: SIGINT to the whole foreground process group), the procs are stopped by it.
IGNORE_SIGINT = partial(signal.signal, signal.SIGINT, signal.SIG_IGN)


def successor_batches(batch_size: int, seq_len: int = SEQ_LEN, vocab: int = VOCAB, noise: float = 0.1,
                      seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(tokens, targets)`` batches with a rule to learn.

    Each token is followed by ``successor[token]`` (a fixed random permutation)
    except that a fraction ``noise`` of tokens is replaced by random ones. A
    model that learns the rule reaches a loss of about 0.8 nats, from ln(64) =
    4.2 for uniform guesses.
    """
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=gen)
    while True:
        seq = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (batch_size,), generator=gen)
        for t in range(seq_len):
            seq[:, t + 1] = successor[seq[:, t]]
        noisy = torch.rand(seq.shape, generator=gen) < noise
        seq = torch.where(noisy, torch.randint(0, vocab, seq.shape, generator=gen), seq)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def successor_shards(dp_rank: int, dp_size: int, start_step: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The data factory each data-parallel rank runs: its contiguous share of :func:`successor_batches`, from ``start_step``."""
    n = batch_size // dp_size
    for i, (x, y) in enumerate(successor_batches(batch_size)):
        if i >= start_step:
            yield x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]


def train_options(args: argparse.Namespace) -> TrainOptions:
    """Clipping, accumulation, warm-up + cosine schedule and precision from the command line."""
    schedule = None
    if args.warmup:
        schedule = LRSchedule(warmup_steps=args.warmup, total_steps=max(args.steps, args.warmup + 1), decay="cosine", min_lr_ratio=0.1)
    return TrainOptions(max_grad_norm=args.max_grad_norm, grad_accum_steps=args.accum, lr_schedule=schedule,
                        param_dtype=None if args.precision == "fp32" else args.precision, peak_flops="measure")


def parse_plan(text: str) -> Plan:
    """``"fsdp=2,tp=2"`` -> ``Plan(fsdp=2, tp=2)`` (integers as ints, other values as strings)."""
    fields: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise argparse.ArgumentTypeError(f"plan items are name=value, got {item!r} (e.g. --plan dp=2,tp=2)")
        value = value.strip()
        fields[key.strip()] = int(value) if value.isdigit() else value
    try:
        return Plan(**fields)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"bad plan {text!r}: {exc}") from exc


# ----------------------------------------------------------- Ctrl-C and failures


class TrainerFailed(Exception):
    """A rank failed (reported by actormesh's supervision); carries the MeshFailure."""

    def __init__(self, failure: MeshFailure) -> None:
        super().__init__(describe_failure(failure))
        self.failure = failure


def describe_failure(failure: MeshFailure) -> str:
    ranks = ", ".join(map(str, failure.crashed_ranks))
    cause = failure.cause.strip().splitlines()[-1] if failure.cause.strip() else "unknown cause"
    return f"rank {ranks} failed: {cause}\n  (actor {failure.actor or failure.mesh_name})"


@dataclass
class Interrupts:
    """Turns SIGINT and actormesh fault reports into exceptions in the main thread.

    actormesh reports an unhandled failure to ``unhandled_fault_hook`` on a
    runtime thread; like the default hook, :meth:`on_fault` then signals the
    main thread with SIGINT to wake it from a blocking ``get()``. The SIGINT
    handler tells the two apart (it counts the signals the hook sent): a
    fault raises :class:`TrainerFailed`, Ctrl-C raises KeyboardInterrupt.
    Once :attr:`shutting_down` is set, faults raise nothing (the shutdown is
    already under way) and Ctrl-C exits the process at once.
    """

    failures: list[MeshFailure] = field(default_factory=list)
    shutting_down: bool = False
    _from_hook: int = 0
    _lock: threading.RLock = field(default_factory=threading.RLock)  # the handler may nest in itself

    def install(self) -> None:
        signal.signal(signal.SIGINT, self.on_sigint)
        am.unhandled_fault_hook = self.on_fault

    def on_fault(self, failure: MeshFailure) -> None:
        """Runs on an actormesh thread."""
        with self._lock:
            self.failures.append(failure)
            self._from_hook += 1
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    def on_sigint(self, signum: int, frame: Any) -> None:
        """Runs in the main thread, between bytecodes."""
        with self._lock:
            from_hook = self._from_hook > 0
            self._from_hook -= from_hook
        if from_hook:
            if not self.shutting_down:
                raise TrainerFailed(self.failures[-1])
            return
        if self.shutting_down:
            os.write(2, b"\nsecond interrupt: exiting now (the procs die with this process)\n")
            os._exit(1 if self.failures else 130)
        self.shutting_down = True  # a second Ctrl-C from here on exits at once
        raise KeyboardInterrupt


# --------------------------------------------------------------------- training


@dataclass
class Run:
    """What the run made (stopped in :meth:`close`) and how far it got."""

    procs: Any = None
    trainer: Any = None
    step: int = 0
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    train_s: float = 0.0
    setup_s: float = 0.0
    last: StepFigures | None = None

    def close(self, console: Console, graceful: bool) -> None:
        """Stop the trainer, then the procs, each wait bounded; then kill whatever is left.

        After a rank failed, the others may be blocked in a collective with it,
        so ``graceful=False`` skips the polite stops and kills the procs.
        """
        for what, mesh in (("trainer", self.trainer), ("procs", self.procs)):
            if mesh is None or not graceful:
                continue
            try:
                mesh.stop().get(timeout=STOP_TIMEOUT_S)
            except Exception as exc:
                console.print(f"stopping the {what}: {type(exc).__name__}: {exc}".splitlines()[0])
        am.shutdown_context()  # kills any proc still running (bounded: ~1s grace, then SIGKILL)


def choose_plan(args: argparse.Namespace, model_fn: Any, sample: Any, procs: Any, console: Console) -> tuple[Plan, list[range] | None]:
    if args.plan is not None:
        console.print(f"plan {args.plan.describe()} (given with --plan; auto_plan skipped)")
        return args.plan, None
    memory = None if args.memory_mib is None else args.memory_mib * 2**20
    choice = auto_plan(model_fn, sample, procs, memory_limit=memory, optimizer_states=2.0)
    console.print(choice.explain())
    return choice.to_plan(), choice.stages


class StepReporter:
    """Step figures: a rich progress bar on a terminal (loss, grad norm, lr, tok/s, MFU, memory),
    a line of step, loss and tokens/s every ``every`` steps otherwise."""

    def __init__(self, console: Console, total: int, every: int) -> None:
        self.console, self.total, self.every = console, total, every
        self.bar: Progress | None = None
        if console.is_terminal:
            self.bar = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("|g| {task.fields[norm]}"),
                                TextColumn("lr {task.fields[lr]}"), TextColumn("{task.fields[rate]} tok/s"),
                                TextColumn("MFU {task.fields[mfu]}"), TextColumn("mem {task.fields[mem]}"),
                                TimeElapsedColumn(), console=console)
            self.task = self.bar.add_task("train", total=total, loss="-", norm="-", lr="-", rate="-", mfu="-", mem="-")

    def __enter__(self) -> StepReporter:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, step: int, fig: StepFigures, tokens_per_s: float) -> None:
        loss = fig.loss
        if self.bar is not None:
            self.bar.update(self.task, completed=step, loss=f"{loss:.4f}", norm=f"{fig.grad_norm:.2f}", lr=f"{fig.lr:.2g}",
                            rate=f"{tokens_per_s:,.0f}", mfu=format_mfu(fig.mfu), mem=format_memory(fig))
        elif step == 1 or step % self.every == 0 or step == self.total:
            self.console.print(f"step {step:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s",
                               highlight=False)
            self.console.file.flush()


def train(args: argparse.Namespace, run: Run, console: Console) -> None:
    start = time.monotonic()
    model_fn = partial(gpt, vocab_size=VOCAB, d_model=args.d_model, n_heads=4, n_blocks=args.blocks, seq_len=SEQ_LEN)
    sample = next(successor_batches(args.batch, seed=1))
    run.procs = this_host().spawn_procs(per_host={"gpus": args.procs}, bootstrap=IGNORE_SIGINT)
    plan, stages = choose_plan(args, model_fn, sample, run.procs, console)
    run.trainer = spawn_trainer(run.procs, model_fn, lm_loss, partial(torch.optim.AdamW, lr=args.lr), plan,
                                stages=stages, timeout=300, options=train_options(args),
                                data=partial(successor_shards, batch_size=args.batch))
    run.setup_s = time.monotonic() - start
    console.print(f"trainer ready on {args.procs} procs in {run.setup_s:.1f}s: {plan.describe()}"
                  + (f", stages {format_stages(stages)}" if stages else ""), highlight=False)
    every = args.log_every or max(1, args.steps // 10)
    with StepReporter(console, args.steps, every) as report:
        t0 = time.monotonic()
        for step in range(1, args.steps + 1):
            fig = trainer_step(run.trainer)
            run.step, run.train_s, run.last = step, time.monotonic() - t0, fig
            run.losses.append(fig.loss)
            run.tokens += fig.tokens
            report.update(step, fig, run.tokens / run.train_s)
    if args.save:
        path = os.path.abspath(args.save)
        run.trainer.save.call(path).get(timeout=300)
        console.print(f"checkpoint saved to {path} (trainer.load(path) resumes it under any plan)")


def format_stages(stages: list[range]) -> str:
    """``[range(0, 1), range(1, 3)]`` -> ``"0 | 1-2"`` (block indices per pipeline stage)."""
    return " | ".join(str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in stages)


def trainer_step(trainer: Any) -> StepFigures:
    """One step on the ranks' own data; every rank returns the same figures."""
    return trainer.step_figures.call().get(timeout=120).values()[0]


def format_mfu(mfu: float | None) -> str:
    return "-" if mfu is None else f"{100 * mfu:.1f}%"


def format_memory(fig: StepFigures) -> str:
    """The largest rank's peak, in MiB (RSS on CPU, torch's allocator on CUDA)."""
    return f"{max(fig.peak_memory_bytes) / 2**20:,.0f} MiB"


def summary(run: Run, wall_s: float) -> str:
    rate = run.tokens / run.train_s if run.train_s else 0.0
    figures = ""
    if run.last is not None:
        figures = f"; MFU {format_mfu(run.last.mfu)}, peak memory {format_memory(run.last)} per rank ({run.last.memory_kind})"
    return (f"done: {run.step} steps, loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}, {rate:,.0f} tokens/s; "
            f"wall time {wall_s:.1f}s (setup {run.setup_s:.1f}s, training {run.train_s:.1f}s){figures}")


def where(run: Run) -> str:
    return f"at step {run.step + 1}" if run.trainer is not None else "during setup"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4, help="procs on this host (default 4)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--plan", type=lambda s: None if s == "auto" else parse_plan(s), default=None,
                   help="'auto' (default: auto_plan chooses) or Plan fields, e.g. dp=4 | fsdp=2,tp=2 | pp=2,dp=2")
    p.add_argument("--batch", type=int, default=16, help="global batch size (default 16)")
    p.add_argument("--blocks", type=int, default=3, help="transformer blocks (default 3)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    p.add_argument("--memory-mib", type=float, default=None, help="auto_plan's memory limit per rank, MiB")
    p.add_argument("--log-every", type=int, default=0, help="without a terminal: a line every N steps (default steps/10)")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this global norm (default: no clipping)")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-steps per step (default 1)")
    p.add_argument("--warmup", type=int, default=0, help="LR warm-up steps, then cosine decay to 0.1x (default 0: constant LR)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="compute dtype (default fp32)")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint (torch.distributed.checkpoint) here at the end")
    args = p.parse_args(argv)
    if args.procs < 1 or args.steps < 1 or args.batch < 1 or args.accum < 1:
        p.error("--procs, --steps, --batch and --accum must be >= 1")
    try:
        train_options(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(highlight=False, markup=False, soft_wrap=True)
    interrupts = Interrupts()
    interrupts.install()
    run = Run()
    start = time.monotonic()
    outcome: BaseException | None = None
    try:
        train(args, run, console)
    except BaseException as exc:  # KeyboardInterrupt, TrainerFailed, errors: all end in the same shutdown
        outcome = exc
    finally:
        interrupts.shutting_down = True
    failed = bool(interrupts.failures) or isinstance(outcome, (TrainerFailed, SupervisionError))
    if isinstance(outcome, KeyboardInterrupt) and not failed:
        console.print(f"\ninterrupted at step {run.step}: stopping the trainer and the procs")
    try:
        run.close(console, graceful=not failed)
    finally:
        sys.stdout.flush()
    if failed:
        why = describe_failure(interrupts.failures[0]) if interrupts.failures else str(outcome).strip()
        print(f"training failed {where(run)}: {why}", file=sys.stderr)
        return 1
    if isinstance(outcome, KeyboardInterrupt):
        console.print("stopped" + (f"; loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f} over {run.step} steps" if run.losses else ""))
        return 130
    if isinstance(outcome, ActorError):  # user code raised on a rank: its traceback names it
        print(f"training failed {where(run)}: {outcome}", file=sys.stderr)
        return 1
    if isinstance(outcome, PlanError):
        print(f"error: {outcome}", file=sys.stderr)
        return 1
    if outcome is not None:
        traceback.print_exception(outcome)
        return 1
    console.print(summary(run, time.monotonic() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
