"""``soak --chaos``: the soak's random prompts with what users do to a server mixed in, and every image
that completed compared with the same prompt's image from a fresh server.

Each prompt may draw one disruption from the seed (``plan_disruption``, about one prompt in three):

- ``interrupt`` (POST /interrupt for that prompt) while it samples, while its first compiled call
  compiles (a prompt with sdopt Compile: just after its first step) or while VAE Decode runs; the same
  prompt is then queued again, as a user presses Queue again, and that run must succeed;
- ``free`` (POST /free, unloading the models and freeing memory) before the prompt or while it samples;
- ``burst``: this prompt and the next ones, 10 to 20 in all, queued at once;
- ``malformed``: a broken copy of the prompt queued first (a node that does not exist, a value out of
  range, a required input left out, a link to no node, a choice an sdopt node does not offer), which
  the server must refuse with 400.

Checkpoint switches come with the prompts, each drawing its checkpoint from ``--model``. The phases are
read from the server's websocket (``executing`` and ``progress`` messages of the soak's client id).

After the run a fresh server runs every prompt that completed, one at a time, and each image must equal
the chaos server's bitwise, or within ``IMAGE_TOLERANCE`` where the chain picks something by timing or
by free memory (``moment_dependent``). The soak fails on a valid prompt that failed, a malformed one
the server took, a ``/system_stats`` that did not answer, an image off by more than it may be, or the
RSS drift past ``--max-drift``.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import UserError
from .prompts import SoakPrompt
from .server import CLIENT_ID, INTERRUPTED, SUCCESS, Client, Rejected, ended_status
from .verdict import PromptOutcome, SoakResult, reading_points

DISRUPTED_SHARE = 0.35
INTERRUPT_PHASES = ("sampling", "compiling", "decoding")
BURST_SIZES = (10, 20)
MALFORMED = ("unknown node", "value out of range", "input left out", "link to no node", "choice not offered")
PHASE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Disruption:
    """What a user does around one prompt: ``kind`` is interrupt, free, burst or malformed; ``detail``
    the phase (interrupt), before or during (free), the prompt count (burst) or the breakage (malformed)."""

    kind: str
    detail: str | int

    def describe(self) -> str:
        if self.kind == "interrupt":
            return f"interrupted while {self.detail}, then queued again"
        if self.kind == "free":
            return f"POST /free {self.detail} it"
        if self.kind == "burst":
            return f"queued at once with the next {int(self.detail) - 1}"
        return f"after a malformed copy ({self.detail})"


def plan_disruption(index: int, seed: int, prompt: SoakPrompt) -> Disruption | None:
    """The disruption around prompt ``index`` of the chaos soak with ``seed``, or None: the same arguments
    always give the same one. ``compiling`` is drawn only for a prompt with sdopt Compile."""
    rng = random.Random(f"sdopt-soak-chaos {seed} {index}")
    if rng.random() >= DISRUPTED_SHARE:
        return None
    kind = rng.choice(("interrupt", "free", "burst", "malformed"))
    if kind == "interrupt":
        phases = INTERRUPT_PHASES if "SDOptCompile" in prompt.nodes() else ("sampling", "decoding")
        return Disruption(kind, rng.choice(phases))
    if kind == "free":
        return Disruption(kind, rng.choice(("before", "during")))
    if kind == "burst":
        return Disruption(kind, rng.randint(*BURST_SIZES))
    return Disruption(kind, rng.choice(MALFORMED))


def malformed_copy(api_prompt: dict, breakage: str) -> dict:
    """``api_prompt`` broken the way ``breakage`` (one of ``MALFORMED``) says, as a user's hand-edited or
    outdated workflow is: the server must refuse it before anything runs."""
    broken = json.loads(json.dumps(api_prompt))
    sampler = broken["sampler"]["inputs"]
    if breakage == "unknown node":
        broken["chaos"] = {"class_type": "SDOptNoSuchNode", "inputs": {"model": ["ckpt", 0]}}
        broken["save"]["inputs"]["images"] = ["chaos", 0]
    elif breakage == "value out of range":
        sampler["steps"] = 0
    elif breakage == "input left out":
        del sampler["model"]
    elif breakage == "link to no node":
        broken["decode"]["inputs"]["samples"] = ["no-such-node", 0]
    else:
        sdopt = [node for node in broken.values() if node["class_type"].startswith("SDOpt")]
        choices = [(node, name) for node in sdopt for name, value in node["inputs"].items() if isinstance(value, str)
                   and name != "filename_prefix" and name != "label"]
        if not choices:
            sampler["sampler_name"] = "no-such-sampler"
        else:
            node, name = choices[0]
            node["inputs"][name] = "no-such-choice"
    return broken


def moment_dependent(prompt: SoakPrompt) -> str:
    """Why ``prompt``'s image may differ between two servers' runs of it within ``IMAGE_TOLERANCE``
    (its chain picks by timing or free memory), or "" where it must be bitwise the same."""
    reasons = []
    for link in (*prompt.model_chain, *prompt.vae_chain):
        inputs = link.inputs
        if link.class_type in ("SDOptAttention", "SDOptVAEAttention") and inputs.get("backend") == "auto":
            reasons.append(f"{link.class_type} auto times the backends")
        elif link.class_type == "SDOptVAEPrecision" and inputs.get("dtype") == "auto":
            reasons.append("VAE Precision auto times the dtypes")
        elif link.class_type == "SDOptTiledVAE" and inputs.get("budget_mb") == 0 and (inputs.get("tile") == 0 or inputs.get("only_when_needed")):
            reasons.append("Tiled VAE sizes its tiles from free memory")
        elif link.class_type == "SDOptCompile":
            reasons.append("Compile on a CPU runs eagerly where its compiled steps timed slower")
    return "; ".join(reasons)


def require_websocket_client() -> None:
    """Refuse, before any server starts, a Python without aiohttp, which reads the server's websocket
    (ComfyUI's own server needs it, so ComfyUI's Python has it)."""
    if importlib.util.find_spec("aiohttp") is None:
        raise UserError("soak --chaos reads the server's websocket with aiohttp: run it with ComfyUI's Python, or pip install aiohttp")


class Events:
    """The server's websocket messages for the soak's client id: per prompt, the node it runs, the steps
    done, and whether it ended. A thread of its own reads them."""

    def __init__(self, url: str):
        self._state: dict[str, dict] = {}
        self._changed = threading.Condition()
        self._connected = threading.Event()
        ws_url = url.replace("http://", "ws://", 1) + f"/ws?clientId={CLIENT_ID}"
        threading.Thread(target=lambda: asyncio.run(self._listen(ws_url)), daemon=True, name="sdopt-chaos-events").start()
        if not self._connected.wait(30):
            raise RuntimeError(f"no websocket connection to {ws_url} within 30 s")

    async def _listen(self, ws_url: str) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, heartbeat=30) as socket:
            self._connected.set()
            async for message in socket:
                if message.type == aiohttp.WSMsgType.TEXT:
                    self._seen(json.loads(message.data))
                elif message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    return

    def _seen(self, message: dict) -> None:
        kind, data = message.get("type"), message.get("data") or {}
        prompt_id = data.get("prompt_id") if isinstance(data, dict) else None
        if not prompt_id:
            return
        with self._changed:
            state = self._state.setdefault(prompt_id, {"node": None, "steps": 0, "ended": False})
            if kind == "executing":
                state["node"] = data.get("node")
                state["ended"] = state["ended"] or data.get("node") is None
            elif kind == "progress":
                state["node"], state["steps"] = data.get("node") or state["node"], int(data.get("value") or 0)
            elif kind in ("execution_success", "execution_error", "execution_interrupted"):
                state["ended"] = True
            self._changed.notify_all()

    def wait_for(self, prompt_id: str, node: str, steps: int = 0, timeout: float = PHASE_TIMEOUT_S) -> bool:
        """True once ``prompt_id`` runs ``node`` with at least ``steps`` steps done; False if it ended first
        or ``timeout`` passed."""
        def reached() -> bool:
            state = self._state.get(prompt_id, {})
            return state.get("ended", False) or (state.get("node") == node and state.get("steps", 0) >= steps)

        with self._changed:
            self._changed.wait_for(reached, timeout)
            state = self._state.get(prompt_id, {})
            return not state.get("ended", False) and state.get("node") == node and state.get("steps", 0) >= steps


# Each interrupt phase as (the node running, steps done): a prompt's first compiled call is its second step.
PHASES = {"sampling": ("sampler", 0), "compiling": ("sampler", 1), "decoding": ("decode", 0)}


@dataclass
class ChaosResult(SoakResult):
    """A soak's result with the chaos' own findings: what each disruption did, the malformed prompts the
    server took, the moments it did not answer, and each completed image against the fresh server's."""

    events: list[str] = field(default_factory=list)
    accepted_malformed: list[str] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    images: dict[int, Path] = field(default_factory=dict)
    differences: list[dict] = field(default_factory=list)

    def problems(self) -> list[str]:
        found = super().problems()
        found += [f"the server took a malformed prompt: {text}" for text in self.accepted_malformed]
        found += [f"/system_stats did not answer {text}" for text in self.unanswered]
        found += [f"prompt {d['index']}'s image is {d['max_levels']:.0f} levels (mean {d['mean_levels']:.2f}) off the fresh "
                  f"server's, more than {d['allowed']}" for d in self.differences if not d["within"]]
        return found

    def summary(self) -> str:
        bitwise = sum(d["max_levels"] == 0 for d in self.differences)
        within = sum(d["within"] for d in self.differences) - bitwise
        head = (f"chaos: {len(self.events)} disruptions, {len(self.differences)} images compared with a fresh server's: {bitwise} "
                f"bitwise equal, {within} within their tolerance, {len(self.differences) - bitwise - within} off it")
        return "\n".join([head, *(f"chaos: {line}" for line in self.events), super().summary()])

    def to_dict(self) -> dict:
        return {**super().to_dict(), "chaos": {"events": self.events, "accepted_malformed": self.accepted_malformed,
                                               "unanswered": self.unanswered, "differences": self.differences}}


def saved_image(entry: dict, output: Path) -> Path | None:
    """The file the prompt's SaveImage wrote, from its history entry."""
    images = (entry.get("outputs", {}).get("save") or {}).get("images") or []
    return output / images[0].get("subfolder", "") / images[0]["filename"] if images else None


def answers(client: Client) -> bool:
    try:
        client.get("/system_stats")
        return True
    except OSError:
        return False


def image_difference(first: Path, second: Path) -> tuple[float, float]:
    """(max, mean) absolute difference of two saved images, in levels of 0–255."""
    import numpy as np
    from PIL import Image

    a, b = (np.asarray(Image.open(path).convert("RGB"), dtype=np.int16) for path in (first, second))
    if a.shape != b.shape:
        return 255.0, 255.0
    levels = np.abs(a - b)
    return float(levels.max()), float(levels.mean())


def with_prefix(api_prompt: dict, prefix: str) -> dict:
    return {**api_prompt, "save": {**api_prompt["save"], "inputs": {**api_prompt["save"]["inputs"], "filename_prefix": prefix}}}


def wait_all(client: Client, prompt_ids: list[str], timeout: float) -> list[tuple[dict | None, float]]:
    """Each prompt's history entry and seconds from the batch's start, in order."""
    start, ended = time.monotonic(), []
    for prompt_id in prompt_ids:
        entry = client.wait(prompt_id, max(1.0, timeout * len(prompt_ids) - (time.monotonic() - start)))
        ended.append((entry, time.monotonic() - start))
    return ended


def run_chaos_prompts(client: Client, result: ChaosResult, plan, timeout: float, output: Path, read_rss, report) -> None:
    """The chaos soak's prompts (``plan(index)`` draws each) with their disruptions; the RSS read through
    ``read_rss(count)`` at the soak's reading points (after a burst that spans one); ``report(outcome)``
    gets each ended prompt."""
    events = Events(client.url)
    points, read_until, index = reading_points(result.prompts, result.warmup), -1, 0

    def ended(planned: SoakPrompt, entry: dict | None, seconds: float, status: str, error: str) -> None:
        outcome = PromptOutcome(planned.index, planned.describe(), status, seconds, error)
        result.outcomes.append(outcome)
        if status == SUCCESS and entry is not None:
            result.images[planned.index] = saved_image(entry, output)
        if not answers(client):
            result.unanswered.append(f"after prompt {planned.index}")
        report(outcome)

    while index < result.prompts:
        if any(read_until < point <= index for point in points):
            read_rss(index)
            read_until = index
        planned = plan(index)
        disruption = plan_disruption(index, result.seed, planned)
        if disruption is not None:
            result.events.append(f"prompt {index}: {disruption.describe()}")
        if disruption is not None and disruption.kind == "burst":
            batch = [planned, *(plan(i) for i in range(index + 1, min(index + int(disruption.detail), result.prompts)))]
            result.events[-1] = f"prompt {index}: {Disruption('burst', len(batch)).describe()}"
            queued = []
            for member in batch:
                try:
                    queued.append((member, client.queue(member.api_prompt())))
                except Rejected as error:
                    ended(member, None, 0.0, "rejected", str(error))
            for (member, _), (entry, seconds) in zip(queued, wait_all(client, [prompt_id for _, prompt_id in queued], timeout)):
                ended(member, entry, seconds, *ended_status(entry, timeout))
            index += len(batch)
            continue
        if disruption is not None and disruption.kind == "malformed":
            try:
                client.queue(malformed_copy(planned.api_prompt(), str(disruption.detail)))
                result.accepted_malformed.append(f"prompt {index} with {disruption.detail}")
            except Rejected:
                pass
        if disruption == Disruption("free", "before"):
            client.free()
        start = time.monotonic()
        try:
            prompt_id = client.queue(planned.api_prompt())
        except Rejected as error:
            ended(planned, None, time.monotonic() - start, "rejected", str(error))
            index += 1
            continue
        if disruption is not None and disruption.kind == "interrupt":
            node, steps = PHASES[str(disruption.detail)]
            if events.wait_for(prompt_id, node, steps):
                client.interrupt(prompt_id)
        elif disruption == Disruption("free", "during"):
            events.wait_for(prompt_id, "sampler")
            client.free()
        entry = client.wait(prompt_id, timeout)
        status, error = ended_status(entry, timeout)
        if status == INTERRUPTED:
            prompt_id = client.queue(planned.api_prompt())
            entry = client.wait(prompt_id, timeout)
            status, error = ended_status(entry, timeout)
        elif disruption is not None and disruption.kind == "interrupt":
            result.events[-1] += " (it ended before the interrupt: nothing to cancel)"
        ended(planned, entry, time.monotonic() - start, status, error)
        index += 1


def compare_with_fresh(client: Client, result: ChaosResult, plan, timeout: float, output: Path, log) -> None:
    """Each prompt that completed in the chaos run, run again on ``client``'s fresh server, its image held
    to the chaos run's: bitwise, or within ``IMAGE_TOLERANCE`` where ``moment_dependent`` says why."""
    from ..bench_speed import IMAGE_TOLERANCE  # torch comes with it: not on the CLI's start-up path

    for index, image in sorted(result.images.items()):
        planned = plan(index)
        prompt_id = client.queue(with_prefix(planned.api_prompt(), f"sdopt-soak-fresh/{index:04d}"))
        entry = client.wait(prompt_id, timeout)
        status, error = ended_status(entry, timeout)
        reason = moment_dependent(planned)
        allowed = f"{IMAGE_TOLERANCE.max_levels:g} levels at most, {IMAGE_TOLERANCE.mean_levels:g} on average ({reason})" if reason else "0 (bitwise)"
        if status != SUCCESS:
            worst, mean = 255.0, 255.0
            allowed += f"; the fresh server's run {status}: {error.splitlines()[0] if error else ''}"
        else:
            worst, mean = image_difference(image, saved_image(entry, output))
        within = status == SUCCESS and (IMAGE_TOLERANCE.admits(worst, mean) if reason else worst == 0)
        result.differences.append({"index": index, "max_levels": worst, "mean_levels": mean, "allowed": allowed, "within": within})
        log(f"chaos: prompt {index} against a fresh server: {worst:.0f} levels at most, {mean:.3f} on average, allowed {allowed}")
