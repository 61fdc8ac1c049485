"""``soak``: the server started, the prompts run one at a time with the memory read between them, the
server stopped and the ComfyUI tree left as it was; the result written as JSON."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ...errors import UserError
from ...families import resolve_model
from ..progress import progress_bar
from .drawn_nodes import REPORT, soak_nodes
from .prompts import DEFAULT_WARMUP, SoakModel, plan_prompt, probe_prompt
from .server import SUCCESS, Client, device_text, log_tail, rss_bytes, run_one, server_env
from .verdict import DEFAULT_MAX_DRIFT, READING_EVERY, PromptOutcome, SoakResult, reading_points

DEFAULT_PROMPTS = 100
PROMPT_TIMEOUT_S = 600.0


def soak(comfyui: Path | None, models: Path | None = None, *, prompts: int = DEFAULT_PROMPTS, seed: int = 0,
         port: int | None = None, max_drift: float = DEFAULT_MAX_DRIFT, warmup: int = DEFAULT_WARMUP,
         model_names: tuple[str, ...] = ("mini",), lora: bool = True, prompt_timeout: float = PROMPT_TIMEOUT_S,
         log: Callable[[str], None] = lambda line: print(line, flush=True)) -> SoakResult:
    """Run the soak (see ``tools.soak``'s docstring); ``log`` gets its status lines, stdout one line per prompt."""
    from ..bench_unet import checkpoint_path
    from ..modelgen import text_encoder_path, write_lora
    from ..serve import LINK_NAME, _comfyui_root, free_port, install_pack, serve, stop, wait_ready

    if prompts < 1:
        raise UserError(f"--prompts {prompts}: run at least 1 prompt")
    warmup = max(0, min(warmup, prompts - 1))  # the warm reading comes before the last prompt at the latest
    if max_drift < 0:
        raise UserError(f"--max-drift {max_drift * 100:g}: give a percentage at or above 0, e.g. 5 for 5%")
    soak_nodes()  # a registered node the soak does not cover stops it here, before the server starts
    root = _comfyui_root(comfyui)
    models = Path(models) if models is not None else root / "models"
    result = SoakResult(seed=seed, prompts=prompts, warmup=warmup, max_drift=max_drift)
    link = root / "custom_nodes" / LINK_NAME
    linked_here = not (link.is_symlink() or link.exists())
    with tempfile.TemporaryDirectory(prefix="sdopt-soak-") as scratch:
        scratch = Path(scratch)
        checkpoints: dict[str, SoakModel] = {}
        loras = scratch / "loras"
        for name in model_names:
            family, size = resolve_model(name)
            path = checkpoint_path(name, models)
            if path.parent.resolve() != (models / "checkpoints").resolve():
                raise UserError(f"--model {name}: the checkpoint must be in {models / 'checkpoints'}, the folder ComfyUI is offered")
            checkpoints[path.name] = SoakModel(
                write_lora(name, loras / f"sdopt-soak-{name}-lora.safetensors").path.name if lora else None,
                text_encoder_path(path).name if family.text_encoder_filename(size) else None, family.clip_type)
        lora_config = scratch / "loras.yaml"
        lora_config.write_text(f"sdopt_soak:\n  loras: {json.dumps(str(loras))}\n")
        (scratch / "output").mkdir()
        (scratch / "user").mkdir()
        port = port or free_port()
        args = ["--output-directory", str(scratch / "output"), "--user-directory", str(scratch / "user"),
                "--input-directory", str(scratch / "input"), "--temp-directory", str(scratch),
                "--database-url", "sqlite:///:memory:", "--extra-model-paths-config", str(lora_config)]
        server_log = scratch / "server.log"
        install_pack(root)
        start = time.monotonic()
        with server_log.open("w") as log_file:
            process = serve(root, models, port, extra_args=args, config_dir=scratch, stdout=log_file, stderr=subprocess.STDOUT,
                            env=server_env(scratch), die_with_parent=True)
        try:
            client = Client(f"http://127.0.0.1:{port}")
            try:
                wait_ready(client.url + f"/object_info/{REPORT}", process, timeout=300)
            except RuntimeError as error:
                raise UserError(f"{error}; the server's log ends:\n{log_tail(server_log)}") from None
            if REPORT not in client.get(f"/object_info/{REPORT}"):
                raise UserError(f"the server runs but did not load sdopt; its log ends:\n{log_tail(server_log)}")
            result.device = device_text(client)
            log(f"soak: ComfyUI at {client.url} ({result.device}), {prompts} prompts, seed {seed}, RSS read after "
                f"{warmup} warm-up prompts, every {READING_EVERY} after them and at the end")
            first = sorted(checkpoints)[0]
            probe = probe_prompt(first, checkpoints[first])
            _run_prompts(client, process, result, checkpoints, probe, prompt_timeout, log)
        finally:
            result.seconds = time.monotonic() - start
            stop(process)
            if linked_here and link.is_symlink():
                link.unlink()  # leave the ComfyUI tree as it was
            if any(o.failed for o in result.outcomes):
                log(f"soak: the server's log ends:\n{log_tail(server_log)}")
    return result


def _run_prompts(client: Client, process, result: SoakResult, checkpoints: dict, probe: dict, timeout: float, log) -> None:
    points = reading_points(result.prompts, result.warmup)

    def run_probe(count: int) -> None:
        status, seconds, error = run_one(client, probe, timeout)
        if status != SUCCESS:
            raise UserError(f"the probe prompt (no sdopt node) before the RSS reading after {count} prompts {status}: {error}")

    def read_rss(count: int) -> None:
        run_probe(count)
        client.collect_garbage()
        # The probe twice more, every output cached, so nothing runs: ComfyUI's worker acts on /free
        # before it takes the next prompt, or at the latest after that prompt has ended (should that
        # prompt have been queued before the worker woke), so the second ends after the collection.
        run_probe(count)
        run_probe(count)
        result.readings.append((count, rss_bytes(process.pid)))

    with progress_bar(total=result.prompts, desc="soak", unit="prompt", disable=not sys.stderr.isatty()) as bar:
        for index in range(result.prompts):
            if index in points:
                read_rss(index)
                if index == result.warmup:
                    log(f"soak: RSS {result.readings[-1][1] / 2**20:,.0f} MiB after {index} warm-up prompts")
            planned = plan_prompt(index, result.seed, checkpoints, result.warmup)
            status, seconds, error = run_one(client, planned.api_prompt(), timeout)
            alive = process.poll() is None
            outcome = PromptOutcome(index, planned.describe(), status, seconds, error, rss_bytes(process.pid) if alive else None)
            result.outcomes.append(outcome)
            rss = f", RSS {outcome.rss_bytes / 2**20:,.0f} MiB" if alive else ""
            bar.write(f"prompt {index + 1}/{result.prompts} {status} {seconds:.1f} s{rss}: {outcome.chain}"
                      + (f"\n  {error}" if error else ""))
            sys.stdout.flush()  # a log shows each prompt as it ends
            bar.update()
            if not alive:
                log(f"soak: the server exited with status {process.returncode} after prompt {index + 1}")
                return
    read_rss(result.prompts)


def write_json(result: SoakResult, path: Path, command: str) -> None:
    path.write_text(json.dumps({"command": command, **result.to_dict()}, indent=2))
