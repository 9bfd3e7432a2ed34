"""Reward functions and the process pool that scores completions with a per-call deadline.

A reward function has one signature::

    fn(completion: str, answer: str | None, *, prompt: str, **kwargs) -> float | None

``kwargs`` are the run spec's ``reward.kwargs``. ``None`` means "cannot score this one". Anything else
that is not a finite number (a string such as ``"1.0"``, NaN) is an error, counted by kind
(:data:`bucketrl.rollout.reward_kinds.FAILURE_KINDS`) like an exception or a timeout. Names the
run spec may use (``reward.name``):

    math             final answer from the last \\boxed{...} (else the last number) vs the reference:
                     exact rational comparison, then math_verify for symbolic forms. Both read Arabic-script
                     numbers (٤٢, ۴۲, ٤٫٥, ١٬٠٠٠, −٣, bidi marks: bucketrl.numerals). kwargs: rel_tol
    exact            completion == answer. kwargs: strip=True, case_sensitive=True
    regex            kwargs pattern=...: 1 if it matches (and, when it has a group and an answer is
                     given, group 1 == answer); without pattern the answer is the pattern (fullmatch).
                     kwargs: pattern, ignore_case
    toy              the built-in toy task's graded reward (bucketrl.tasks.toy.toy_reward)
    module:function  any function with the signature above, from a module importable from PYTHONPATH,
                     the installed packages, or the current directory (``myreward.py`` beside you:
                     ``myreward:score``)

:class:`RewardPool` runs the function in separate processes: one that raises, returns garbage or runs
past ``timeout_s`` yields ``None`` for that completion (counted), and a hung or crashed process is
replaced. The caller never sees an exception from a reward. A reward that hangs on everything costs a batch
only two rounds of deadlines, not one per completion: once the first ``hang_probe`` completions of a batch have
all run past ``timeout_s`` (and none answered), the rest of the batch is marked timed out without a call.

    pool = RewardPool(RewardSpec(name="math"), workers=2, timeout_s=10)
    pool.score([RewardItem("... \\boxed{42}", "42", "What is 6*7?")])   # -> [1.0]
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import multiprocessing as mp
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import wait
from typing import Any

from bucketrl import errors
from bucketrl.numerals import normalise_numerals
from bucketrl.rollout.reward_kinds import Scored, classify_reward
from bucketrl.tasks.toy import toy_reward
from bucketrl.wire import RewardSpec

log = logging.getLogger(__name__)

RewardFn = Callable[..., Any]

# -- built-in rewards -------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
# Longer final answers are not handed to math_verify (see math_reward).
MAX_SYMBOLIC_CHARS = 1000
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent or unclosed."""
    best: str | None = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1]
    return best


def extract_final_answer(text: str) -> str | None:
    """The last boxed expression, else the last number in ``text``."""
    boxed = extract_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def _to_fraction(s: str) -> Fraction | None:
    s = _strip_answer(s).replace(" ", "")
    # A comma is a thousands separator only between groups of three digits: "3,4" (a list, or a European
    # decimal) is no number here, where it used to read as 34.
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"^\\(?:text|mathrm)\{(.*)\}$", r"\1", s)
    m = re.fullmatch(r"\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    if len(s) > 100:  # Fraction of a huge literal is slow and never a real answer
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _strip_answer(s: str) -> str:
    """Without the math delimiters around it and the sentence's end after it (``.``, ``?``, ``,``)."""
    return s.strip().strip("$").strip().rstrip(".?,;").rstrip()


def _normalise(s: str) -> str:
    s = _strip_answer(s)
    return re.sub(r"\s+|\\!|\\,|\\left|\\right", "", s)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def math_reward(completion: str, answer: str | None, *, prompt: str = "", rel_tol: float = 1e-6) -> float | None:
    """1.0 when the completion's final answer equals the reference, else 0.0; None without a reference."""
    if answer is None or not str(answer).strip():
        return None
    # Both sides: a reference written in Arabic numerals is compared like a completion written in them.
    pred = extract_final_answer(normalise_numerals(completion))
    if pred is None:
        return 0.0
    ref = normalise_numerals(str(answer))
    ref_boxed = extract_boxed(ref)
    ref = ref_boxed if ref_boxed is not None else ref
    a, b = _to_fraction(pred), _to_fraction(ref)
    if a is not None and b is not None:
        return 1.0 if abs(a - b) <= rel_tol * max(Fraction(1), abs(b)) else 0.0
    if _normalise(pred) == _normalise(ref):
        return 1.0
    if len(pred) > MAX_SYMBOLIC_CHARS or len(ref) > MAX_SYMBOLIC_CHARS:
        # math_verify spent its whole 5 s parsing a 20,000-digit box: no real answer is that long.
        return 0.0
    try:
        from math_verify import parse, verify
    except ImportError:
        return 0.0
    # math_verify's timeouts use SIGALRM, which only the main thread may arm.
    timeout = 5 if _in_main_thread() else None
    gold = parse(f"${ref}$", parsing_timeout=timeout)
    target = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
    if not gold or not target:
        return 0.0
    return 1.0 if verify(gold, target, timeout_seconds=timeout) else 0.0


def exact_reward(
    completion: str, answer: str | None, *, prompt: str = "", strip: bool = True, case_sensitive: bool = True
) -> float | None:
    """1.0 when the completion equals the answer."""
    if answer is None:
        return None
    a, b = (completion.strip(), str(answer).strip()) if strip else (completion, str(answer))
    if not case_sensitive:
        a, b = a.casefold(), b.casefold()
    return 1.0 if a == b else 0.0


def regex_reward(
    completion: str, answer: str | None, *, prompt: str = "", pattern: str | None = None, ignore_case: bool = False
) -> float | None:
    """See the module docstring for the rules."""
    flags = re.IGNORECASE if ignore_case else 0
    if pattern is None:
        if answer is None:
            return None
        return 1.0 if re.fullmatch(str(answer), completion.strip(), flags) else 0.0
    m = re.search(pattern, completion, flags)
    if m is None:
        return 0.0
    if answer is not None and m.re.groups:
        return 1.0 if (m.group(1) or "").strip() == str(answer).strip() else 0.0
    return 1.0


BUILTIN: dict[str, RewardFn] = {
    "math": math_reward,
    "exact": exact_reward,
    "regex": regex_reward,
    "toy": toy_reward,
}


def resolve_reward(name: str) -> RewardFn:
    """The function a run's ``reward.name`` means; ``Invalid`` with the reason when there is none."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise errors.Invalid(f"reward.name {name!r} is not one of {sorted(BUILTIN)} and not 'module:function'")
    module_name, _, attr = name.partition(":")
    # The user's module lives where they run the command: the current directory is searched (after
    # PYTHONPATH and installed packages), also under the `bucketrl` console script, whose sys.path lacks it.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module raising at import time
        raise errors.Invalid(f"reward.name {name!r}: cannot import {module_name!r}: {exc!r}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise errors.Invalid(f"reward.name {name!r}: {module_name!r} has no callable {attr!r}")
    return fn


def validate_reward(spec: RewardSpec) -> RewardFn:
    """Resolve the function and check that it accepts ``reward.kwargs`` (and the regex compiles)."""
    fn = resolve_reward(spec.name)
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(spec.kwargs) - set(params))
        if unknown:
            raise errors.Invalid(f"reward {spec.name!r} does not accept reward.kwargs {unknown}")
    if fn is regex_reward and spec.kwargs.get("pattern") is not None:
        try:
            re.compile(str(spec.kwargs["pattern"]))
        except re.error as exc:
            raise errors.Invalid(f"reward.kwargs.pattern is not a valid regex: {exc}") from exc
    return fn


# -- the pool ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardItem:
    completion: str
    answer: str | None
    prompt: str


def _worker_main(conn: Any, name: str, kwargs: dict[str, Any]) -> None:
    """Scoring process: resolve once, then for each chunk [(idx, completion, answer, prompt), ...] send one
    (idx, ok, value) per item as soon as it is scored (so the parent's deadline is per item)."""
    fn = resolve_reward(name)
    if fn is math_reward:
        import math_verify  # noqa: F401  (sympy takes seconds to import: not inside the first deadline)
    conn.send(("ready", True, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        for idx, completion, answer, prompt in msg:
            try:
                value, kind, message = classify_reward(fn(completion, answer, prompt=prompt, **kwargs))
                conn.send((idx, True, Scored(value, kind, message)))
            except BaseException as exc:  # a reward's failure must never take the process down
                conn.send((idx, False, f"{type(exc).__name__}: {exc}"[:500]))


class _Proc:
    """One scoring process and its pipe. ``jobs``: indices sent and not answered yet, in order (the first
    is being scored); ``deadline``: when the current one (or the start-up) times out."""

    def __init__(self, ctx: Any, name: str, kwargs: dict[str, Any], start_timeout_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, name, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.jobs: list[int] = []
        self.deadline = time.monotonic() + start_timeout_s

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    """Score completions in ``workers`` processes, each call bounded by ``timeout_s``.

    Items go out in chunks (one pipe message per process per round: the IPC cost stays small next to the
    engine's), but every item has its own deadline: a hung item is None, the rest of its chunk is sent
    again to a fresh process. ``score`` may be called from any one thread at a time (it holds a lock).
    Counters: ``unscorable_total`` (every None), ``timeouts_total``, ``errors_total``, ``crashes_total``;
    :meth:`score_detailed` says for each item why it has no value.

    ``hang_probe`` (default: twice the workers, two rounds of deadlines): when that many of a batch's completions
    have run past ``timeout_s`` and none has answered yet, the reward is taken to hang on everything and the rest
    of the batch is timed out at once (``skipped_total``). Without it the 64 completions of a demo step, scored
    by `bucketrl up`'s one process per generator, took 64 deadlines (10+ minutes at 10 s) before the trainer
    could see that nothing scores; now they take two. A reward that is slow but answers is unaffected: one
    answer in the batch ends the probe. One that hangs on a share ``h`` of the completions loses a whole batch
    with probability ``h ** hang_probe`` (``hang_probe=0`` turns the probe off).
    """

    MAX_CHUNK = 64

    def __init__(
        self,
        spec: RewardSpec,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        start_timeout_s: float = 120.0,
        on_failure: Callable[[Scored], None] | None = None,
        hang_probe: int | None = None,
    ) -> None:
        validate_reward(spec)  # a clear error now, not "unscorable" for every completion later
        self.spec = spec
        # Called (on the scoring thread) with each item that has no value, as soon as it is known: a reward that
        # hangs takes timeout_s per item, and a batch's results come only at its end (minutes later).
        self.on_failure = on_failure
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.unscorable_total = 0
        self.timeouts_total = 0
        self.errors_total = 0
        self.crashes_total = 0
        self.skipped_total = 0
        # True from a deadline passed with no answer in its batch, until the next answer: the submitter does not
        # wait for such a reward when it shuts down.
        self.hanging = False
        self.hang_probe = hang_probe if hang_probe is not None else 2 * workers
        self._ctx = mp.get_context("spawn")  # never fork a process that holds an engine and threads
        self._lock = threading.Lock()
        self._closed = False
        self._procs = [self._spawn() for _ in range(workers)]

    def _spawn(self) -> _Proc:
        return _Proc(self._ctx, self.spec.name, dict(self.spec.kwargs), self.start_timeout_s)

    def score(self, items: list[RewardItem], cancel: threading.Event | None = None) -> list[float | None]:
        """One reward per item, in order; None where the function raised, hung, crashed or returned garbage.

        Setting ``cancel`` (a shutdown) stops within ~0.2 s: items not scored yet are None, busy processes
        are replaced."""
        return [r.value for r in self.score_detailed(items, cancel)]

    def score_detailed(self, items: list[RewardItem], cancel: threading.Event | None = None) -> list[Scored]:
        """Like :meth:`score`, with the failure kind and message of every item that has no value."""
        if not items:
            return []
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            results = self._score(items, cancel)
        self.unscorable_total += sum(r.value is None for r in results)
        return results

    def _dispatch(self, items: list[RewardItem], todo: list[int]) -> None:
        idle = [p for p in self._procs if p.ready and not p.jobs]
        # Processes still starting (a replaced one) get their share when ready: handing everything to the ready
        # ones made a hanging reward's deadlines run one after another instead of side by side.
        free = sum(1 for p in self._procs if not p.jobs)
        for i, p in enumerate(idle):
            if not todo:
                return
            # Spread what is left evenly over the processes without work.
            size = min(self.MAX_CHUNK, -(-len(todo) // (free - i)))
            chunk, todo[:] = todo[:size], todo[size:]
            try:
                p.conn.send([(j, items[j].completion, items[j].answer, items[j].prompt) for j in chunk])
            except (OSError, ValueError):
                todo[:0] = chunk
                self._replace(p, crashed=True)
                continue
            p.jobs, p.deadline = chunk, time.monotonic() + self.timeout_s

    def _score(self, items: list[RewardItem], cancel: threading.Event | None) -> list[Scored]:

        # Until scored: what an item that never gets an answer is (a cancel, or start-up failures).
        results: list[Scored] = [Scored(None, "timeout", "not scored: the scoring processes did not answer")] * len(
            items
        )
        todo = list(range(len(items)))
        failed_starts = 0
        answered = timed_out = 0  # this batch's: the hang probe (see the class docstring)
        while todo or any(p.jobs for p in self._procs):
            self._dispatch(items, todo)
            watched = [p for p in self._procs if p.jobs or not p.ready]
            if not watched:
                continue
            if cancel is not None and cancel.is_set():
                for p in self._procs:
                    if p.jobs:
                        self._replace(p, crashed=False)
                break
            # Wait for a result, a process becoming ready, or the nearest deadline.
            timeout = max(0.0, min(p.deadline for p in watched) - time.monotonic())
            if cancel is not None:
                timeout = min(timeout, 0.2)
            by_conn = {p.conn: p for p in watched}
            for conn in wait(list(by_conn), timeout=timeout):
                p = by_conn[conn]
                while p.ready is False or p.jobs:
                    try:
                        if not p.conn.poll():  # p.conn is conn: wait() types what it answers as any waitable
                            break
                        tag, ok, value = p.conn.recv()
                    except (EOFError, OSError):
                        if not p.ready:
                            failed_starts += 1
                        elif p.jobs:  # the item being scored killed the process: it alone is lost
                            answered += 1
                            self.hanging = False
                            results[p.jobs[0]] = Scored(None, "exception", "the reward function killed its process")
                            self._failed(results[p.jobs[0]])
                            todo[:0] = p.jobs[1:]
                        self._replace(p, crashed=True)
                        break
                    if tag == "ready":
                        p.ready = True
                        continue
                    answered += 1
                    self.hanging = False
                    if p.jobs and p.jobs[0] == tag:
                        p.jobs.pop(0)
                        p.deadline = time.monotonic() + self.timeout_s
                    if ok:
                        results[tag] = value
                    else:
                        self.errors_total += 1
                        results[tag] = Scored(None, "exception", value)
                        log.warning("reward %s raised: %s", self.spec.name, value)
                    self._failed(results[tag])
            hung, not_started = self._expire(results, todo, answered)
            timed_out += hung
            failed_starts += not_started
            if self.hang_probe and timed_out >= self.hang_probe and not answered:
                self._skip_hung(results, todo, timed_out)
                break
            if failed_starts > 2 * len(self._procs):
                log.error("reward processes keep failing to start; leaving %d items unscorable", len(todo))
                break
        return results

    def _expire(self, results: list[Scored], todo: list[int], answered: int) -> tuple[int, int]:
        """Replace the processes past their deadline: one scoring an item (it times out, the rest of its jobs go
        back to ``todo``) or one that never started. Returns how many of each."""
        timed_out = failed_starts = 0
        now = time.monotonic()
        for p in list(self._procs):
            if p.deadline > now or (p.ready and not p.jobs):
                continue
            if p.jobs:
                self.timeouts_total += 1
                timed_out += 1
                self.hanging = not answered
                log.warning("reward %s exceeded %.1fs; replacing its process", self.spec.name, self.timeout_s)
                results[p.jobs[0]] = Scored(
                    None, "timeout", f"the reward function ran past {self.timeout_s:g}s (BUCKETRL_REWARD_TIMEOUT_S)"
                )
                self._failed(results[p.jobs[0]])
                todo[:0] = p.jobs[1:]  # only the hung item is lost
            else:
                failed_starts += 1
                log.error("reward process did not start within %.0fs", self.start_timeout_s)
            self._replace(p, crashed=False)
        return timed_out, failed_starts

    def _skip_hung(self, results: list[Scored], todo: list[int], timed_out: int) -> None:
        """The batch's first ``timed_out`` completions all ran past the deadline and none answered: time out the
        rest without calling the reward (the processes still busy are hung too: replaced)."""
        rest = list(todo)
        todo.clear()
        for p in list(self._procs):
            if p.jobs:
                rest += p.jobs
                self._replace(p, crashed=False)
        if not rest:
            return
        self.skipped_total += len(rest)
        log.warning(
            "reward %s ran past %.1fs on each of the first %d completions of this batch and answered none; "
            "timing out the other %d without calling it",
            self.spec.name,
            self.timeout_s,
            timed_out,
            len(rest),
        )
        skipped = Scored(
            None,
            "timeout",
            f"the reward function ran past {self.timeout_s:g}s (BUCKETRL_REWARD_TIMEOUT_S) on each of the first "
            f"{timed_out} completions of its batch; not called on this one",
        )
        for i in rest:
            results[i] = skipped
            self._failed(skipped)

    def _failed(self, scored: Scored) -> None:
        if scored.kind is None or self.on_failure is None:
            return
        try:
            self.on_failure(scored)
        except Exception:  # a note must never stop the scoring
            log.exception("reward on_failure hook failed")

    def _replace(self, p: _Proc, *, crashed: bool) -> None:
        if crashed:
            self.crashes_total += 1
        p.kill()
        self._procs[self._procs.index(p)] = self._spawn()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in self._procs:
                with contextlib.suppress(OSError, ValueError):
                    p.conn.send(None)
            for p in self._procs:
                p.proc.join(2)
                p.kill()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
