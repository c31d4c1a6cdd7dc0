"""`jlora bench soak`: `jlora serve` under sustained mixed load, watched for what a long run breaks.

Starts `jlora serve` as a subprocess on 127.0.0.1 (a free port) with several PEFT adapters (random,
written here) and runtime adapter loading on, then for `--duration` seconds sends requests with
Poisson arrivals (`--rate` req/s): completions and chats, streamed and whole, over the base model
and the adapters in turn, with random max_tokens (EOS ignored). Meanwhile:

- a streaming client walks away after its first chunks (`--walk-away`, a fraction of streams);
- one adapter ("churn") is unloaded and loaded again through /v1/unload_lora_adapter and
  /v1/load_lora_adapter every `--churn-every` seconds, while requests keep naming it (a 404 while
  it is unloaded is its right answer);
- a greedy probe (a fixed prompt, on the base model and on the first adapter, whose slot the
  others take in turn) runs every `--probe-every` seconds: its output must not change over the run;
- the server's resident memory (VmRSS of /proc/<pid>/status) is sampled every second.

Every request ends in one of: completed (200, whole, or a stream to `[DONE]`), walked away (the
client left on purpose), refused to retry (429 or 503), not found (404 on the churn adapter while
unloaded), rejected (another 4xx: a bug in this bench or the server), or lost (no answer in time, a
connection error, a 5xx, or a stream that ended without `[DONE]` or with an error event).
Reported: those counts, latency and TTFT p50/p99 of the completed ones, RSS over time (after the
first 10 s and at the end), whether the probe stayed the same, every churn call's status, and the
engine's gauges from /metrics once all clients are done (nothing running, waiting or holding a KV
block, and no compilation after warm-up).
`--out DIR` writes DIR/soak.json and DIR/soak.md.

    jlora bench soak [--model tiny|default|PATH] [--rate 2] [--duration 60] [--adapters 3] [--out DIR]

`--model tiny` (the default) writes a tiny random Llama with the default model's tokenizer, as the
tests make; `default` serves SmolLM2-135M-Instruct (LLM()'s default); a PATH serves that checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = ["Once upon a time", "The quick brown fox", "Dear diary,", "In the beginning", "Roses are red",
           "Knock knock", "1 2 3 4", "Hello there"]
QUESTIONS = ["How many legs does a spider have?", "What do bees make?", "What is the capital of France?",
             "Describe the sea in one sentence.", "Why do we sleep?", "Tell me about the moon."]
PROBE = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
CHURN = "churn"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False,
            rope_theta=10000.0, rope_scaling=None, bos_token_id=1, eos_token_id=2)
ADAPTER_ALPHA_SCALE = 64  # write_peft_adapter's B ~ N(0, 0.01^2) barely moves a greedy pick: scale it up
OUTCOMES = ("completed", "walked_away", "refused_retry", "not_found", "rejected", "lost")


# ---- the model and adapters --------------------------------------------------------------------------


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama (2 layers, hidden 64, float32) with the default model's tokenizer and chat
    template, as tests/conftest.py makes (the lm head scaled 8x, so greedy picks are clear-cut)."""
    from safetensors.numpy import save_file

    from jlora.models import default_model_path
    from jlora.models.random_checkpoint import random_config, random_tensors
    from jlora.tokenizer import load_gguf_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    config = {**random_config(TINY), "torch_dtype": "float32"}
    tensors = {name: t.rows() for name, t in random_tensors(config, "float32", seed).items()}
    tensors["lm_head.weight"] *= 8.0
    save_file(tensors, str(path / "model.safetensors"))
    load_gguf_tokenizer(default_model_path()).save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_adapters(model: str | None, root: Path, n: int, rank: int, seed: int = 0) -> list[Path]:
    """`n` random all-linear PEFT adapters a0..a{n-1} and the churn one, for `model`'s shapes."""
    from jlora.bench.peft_adapters import ALL_LINEAR, write_peft_adapter
    from jlora.models.loading import read_model_config

    cfg = read_model_config(model)
    rng = np.random.default_rng(seed)
    paths = [write_peft_adapter(root / name, cfg, rank, ALL_LINEAR, rng) for name in [*(f"a{i}" for i in range(n)), CHURN]]
    for p in paths:  # strong enough that each adapter's greedy output differs from the base model's
        config = json.loads((p / "adapter_config.json").read_text())
        config["lora_alpha"] *= ADAPTER_ALPHA_SCALE
        (p / "adapter_config.json").write_text(json.dumps(config))
    return paths


# ---- the server --------------------------------------------------------------------------------------


def start_server(model: str | None, root: Path, names: list[str], args: argparse.Namespace,
                 log_path: Path) -> tuple[subprocess.Popen, str]:
    """`jlora serve` on 127.0.0.1, a free port; returns the process and its base URL once it serves."""
    cmd = [sys.executable, "-c", "from jlora.cli import main; raise SystemExit(main())", "serve",
           "--host", "127.0.0.1", "--port", "0", "--log-level", "warning", "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-loras", str(args.max_loras),
           "--max-lora-rank", str(args.lora_rank), "--enable-runtime-lora-updating", "--lora-root", str(root),
           "--lora-modules", *(f"{n}={root / n}" for n in names)]
    if model is not None:
        cmd += ["--model", model]
    if args.token_buckets:
        cmd += ["--token-buckets", args.token_buckets]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            # What it prints later goes to the log too (an unread pipe would block it once full).
            threading.Thread(target=lambda: shutil.copyfileobj(proc.stdout, log), daemon=True).start()
            _wait_healthy(m.group(1), deadline)
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError(f"jlora serve did not start (see {log_path}):\n{log_path.read_text()[-2000:]}")


def _wait_healthy(base_url: str, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{base_url}/health did not answer 200")


def rss_kib(pid: int) -> int | None:
    """VmRSS of process `pid` in KiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """SIGTERM, then wait; the exit status (None if it had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


# ---- the load ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    kind: str  # "completion" / "chat", "+stream"
    model: str
    outcome: str  # one of OUTCOMES
    status: int | None = None
    latency: float | None = None
    ttft: float | None = None
    detail: str = ""
    sent_at: float = 0.0  # seconds into the run


class Soak:
    def __init__(self, base_url: str, pid: int, base_model: str, adapters: list[str], root: Path,
                 args: argparse.Namespace):
        self.base_url, self.pid, self.base_model, self.root, self.args = base_url, pid, base_model, root, args
        self.models = [base_model, *adapters, CHURN]
        self.probe_models = [base_model, *adapters[:1]]  # the base model and the first adapter
        self.rng = random.Random(args.seed)
        self.outcomes: list[Outcome] = []
        self.probes: list[dict[str, Any]] = []
        self.churns: list[dict[str, Any]] = []
        self.rss: list[tuple[float, int]] = []
        self.churn_loaded = True
        self.t0 = 0.0
        self.end_state: dict[str, float] = {}

    def _now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=50)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(self.args.request_timeout),
                                     limits=limits, trust_env=False) as client:
            self.t0 = time.monotonic()
            sidecars = [asyncio.create_task(self._sample_rss()), asyncio.create_task(self._probe(client)),
                        asyncio.create_task(self._churn(client))]
            tasks = []
            next_at = self.rng.expovariate(self.args.rate)
            while next_at < self.args.duration:
                await asyncio.sleep(max(0.0, next_at - self._now()))
                tasks.append(asyncio.create_task(self._request(client)))
                next_at += self.rng.expovariate(self.args.rate)
            await asyncio.sleep(max(0.0, self.args.duration - self._now()))
            for t in sidecars[1:]:  # no probe or churn after the arrivals end; RSS until all have answered
                t.cancel()
            await asyncio.gather(*tasks)
            if not self.churn_loaded:  # leave the server as it began
                await self._churn_once(client)
            await self._probe_once(client)  # the last probe, after everything
            sidecars[0].cancel()
            self.rss.append((self._now(), rss_kib(self.pid) or 0))
            self.end_state = await self._end_state(client)

    async def _end_state(self, client: Any, wait_s: float = 15.0) -> dict[str, float]:
        """The engine's gauges once every client is done (waiting up to `wait_s` for the last
        walk-aways' aborts): nothing should run, wait or hold a KV block."""
        names = {"jlora_num_requests_running": "running", "jlora_num_requests_waiting": "waiting",
                 "jlora_kv_blocks_used": "kv_blocks_used", "jlora_xla_compiles_after_warmup": "compiles_after_warmup",
                 "jlora_num_preemptions": "preemptions", "jlora_lora_evictions": "lora_evictions"}
        deadline, state = time.monotonic() + wait_s, {}
        while True:
            try:
                text = (await client.get("/metrics")).text
            except Exception:  # noqa: BLE001 (reported as no state)
                return {}
            state = {}
            for line in text.splitlines():
                key, _, value = line.rpartition(" ")
                if key.split("{")[0].removesuffix("_total") in names:
                    state[names[key.split("{")[0].removesuffix("_total")]] = float(value)
            idle = all(state.get(k) == 0 for k in ("running", "waiting", "kv_blocks_used"))
            if idle or time.monotonic() > deadline:
                state["idle"] = idle
                return state
            await asyncio.sleep(0.5)

    async def _sample_rss(self) -> None:
        while True:
            kib = rss_kib(self.pid)
            if kib is not None:
                self.rss.append((self._now(), kib))
            await asyncio.sleep(1.0)

    async def _probe(self, client: Any) -> None:
        while True:
            await self._probe_once(client)
            await asyncio.sleep(self.args.probe_every)

    async def _probe_once(self, client: Any) -> None:
        t = self._now()
        for model in self.probe_models:
            try:
                r = await client.post("/v1/completions", json={"model": model, **PROBE})
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
                self.probes.append({"t": round(t, 1), "model": model, "status": r.status_code, "text": text})
            except Exception as e:  # noqa: BLE001 (recorded: a probe without an answer)
                self.probes.append({"t": round(t, 1), "model": model, "status": None, "text": None,
                                    "error": repr(e)})

    async def _churn(self, client: Any) -> None:
        while True:
            await asyncio.sleep(self.args.churn_every)
            await self._churn_once(client)

    async def _churn_once(self, client: Any) -> None:
        t = self._now()
        if self.churn_loaded:
            action, path, body = "unload", "/v1/unload_lora_adapter", {"lora_name": CHURN}
        else:
            action, path, body = "load", "/v1/load_lora_adapter", {"lora_name": CHURN, "lora_path": CHURN}
        try:
            r = await client.post(path, json=body)
            status = r.status_code
        except Exception as e:  # noqa: BLE001 (recorded as unanswered)
            status = None
            self.churns.append({"t": round(t, 1), "action": action, "status": None, "error": repr(e)})
        else:
            self.churns.append({"t": round(t, 1), "action": action, "status": status,
                                "seconds": round(self._now() - t, 3)})
        if status == 200:
            self.churn_loaded = action == "load"

    def _body(self) -> tuple[str, dict[str, Any], bool, bool]:
        rng = self.rng
        model = self.models[rng.randrange(len(self.models))]
        chat = rng.random() < 0.5
        stream = rng.random() < self.args.stream_fraction
        walk = stream and rng.random() < self.args.walk_away
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(4, self.args.max_tokens),
                                "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        else:
            body["prompt"] = rng.choice(PROMPTS)
        if stream:
            body["stream_options"] = {"include_usage": True}
        return ("chat" if chat else "completion") + ("+stream" if stream else ""), body, stream, walk

    async def _request(self, client: Any) -> None:
        kind, body, stream, walk = self._body()
        path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
        out = Outcome(kind, body["model"], "lost", sent_at=round(self._now(), 2))
        t0 = time.monotonic()
        try:
            if stream:
                await self._stream(client, path, body, walk, out, t0)
            else:
                r = await client.post(path, json=body)
                out.status = r.status_code
                if r.status_code == 200:
                    out.outcome, out.latency = "completed", time.monotonic() - t0
                else:
                    self._refused(out, r.status_code, r.text)
        except Exception as e:  # noqa: BLE001 (no answer: a timeout, a reset connection)
            out.outcome, out.detail = "lost", repr(e)[:300]
        self.outcomes.append(out)

    async def _stream(self, client: Any, path: str, body: dict[str, Any], walk: bool, out: Outcome,
                      t0: float) -> None:
        leave_after = self.rng.randint(1, 3)
        async with client.stream("POST", path, json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                self._refused(out, r.status_code, (await r.aread()).decode(errors="replace"))
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if out.outcome == "lost" and not out.detail:
                        out.outcome, out.latency = "completed", time.monotonic() - t0
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    out.outcome, out.detail = "lost", f"error event: {event['error'].get('message', '')[:200]}"
                    continue
                choices = event.get("choices") or []
                if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    chunks += 1
                    if out.ttft is None:
                        out.ttft = time.monotonic() - t0
                if walk and chunks >= leave_after:
                    out.outcome = "walked_away"
                    return  # closing the response drops the connection mid-stream
            out.detail = out.detail or "the stream ended without [DONE]"

    def _refused(self, out: Outcome, status: int, text: str) -> None:
        if status in (429, 503):
            out.outcome = "refused_retry"
        elif status == 404 and out.model == CHURN:
            out.outcome = "not_found"
        elif 400 <= status < 500:
            out.outcome = "rejected"
        else:
            out.outcome = "lost"
        out.detail = f"{status}: {text[:200]}"


# ---- the report --------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def _by_third(done: list[Outcome], duration: float) -> list[float | None]:
    """Latency p50 of the requests sent in each third of the run: a queue that grows shows as a rise."""
    return [_pct([o.latency for o in done if i * duration / 3 <= o.sent_at < (i + 1) * duration / 3], 50)
            for i in range(3)]


def summarize(soak: Soak, args: argparse.Namespace, exit_code: int | None, start_s: float) -> dict[str, Any]:
    outs = soak.outcomes
    counts = {k: sum(o.outcome == k for o in outs) for k in OUTCOMES}
    done = [o for o in outs if o.outcome == "completed"]
    ttfts = [o.ttft for o in outs if o.ttft is not None and o.outcome == "completed"]
    rss = [(round(t, 1), round(k / 1024, 1)) for t, k in soak.rss]
    after_10 = next((m for t, m in rss if t >= 10.0), rss[-1][1] if rss else None)
    texts: dict[str, list[str | None]] = {}
    for p in soak.probes:
        texts.setdefault(p["model"], []).append(p["text"])
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "server_start_s": round(start_s, 1),
        "sent": len(outs), **counts,
        "http_5xx": sum(o.status is not None and o.status >= 500 for o in outs),
        "by_kind": {k: sum(o.kind == k for o in outs) for k in sorted({o.kind for o in outs})},
        "latency_p50_ms": _pct([o.latency for o in done], 50), "latency_p99_ms": _pct([o.latency for o in done], 99),
        "ttft_p50_ms": _pct(ttfts, 50), "ttft_p99_ms": _pct(ttfts, 99),
        "latency_p50_ms_by_third": _by_third(done, args.duration),
        "rss_mib_after_10s": after_10, "rss_mib_end": rss[-1][1] if rss else None,
        "rss_mib_max": max((m for _, m in rss), default=None), "rss_mib": rss,
        "probe_unchanged": bool(texts) and all(t is not None and t == ts[0] for ts in texts.values() for t in ts),
        # An adapter probe that reads like the base model's could not show an adapter served from the wrong slot.
        "probe_adapter_differs": len(texts) > 1 and len({ts[0] for ts in texts.values()}) == len(texts),
        "probes": soak.probes, "churns": soak.churns,
        "churn_statuses": [c["status"] for c in soak.churns],
        "end_state": soak.end_state,
        "server_exit_code": exit_code,
        "problems": [dataclasses.asdict(o) for o in outs if o.outcome in ("lost", "rejected")][:20],
    }


def _end_words(state: dict[str, float]) -> str:
    if not state:
        return "no /metrics answer"
    words = ", ".join(f"{k} {v:g}" for k, v in state.items() if k != "idle")
    return f"{'idle' if state.get('idle') else 'NOT idle'} ({words})"


def format_markdown(r: dict[str, Any]) -> str:
    c = r["config"]
    rss = r["rss_mib"]
    step = max(1, len(rss) // 12)
    lines = [
        f"Soak: model {c['model']}, {c['duration']:g} s at {c['rate']:g} req/s (Poisson), {c['adapters']} adapters + "
        f"'{CHURN}' unloaded/reloaded every {c['churn_every']:g} s, streams {c['stream_fraction']:.0%} "
        f"(of which {c['walk_away']:.0%} walk away), max_tokens 4-{c['max_tokens']}, dtype {c['dtype']}.",
        "",
        "| sent | completed | walked away | refused (429/503) | not found (churn) | rejected (4xx) | lost | 5xx |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['sent']} | {r['completed']} | {r['walked_away']} | {r['refused_retry']} | {r['not_found']} | "
        f"{r['rejected']} | {r['lost']} | {r['http_5xx']} |",
        "",
        "| latency p50 ms | latency p99 ms | TTFT p50 ms | TTFT p99 ms | RSS after 10 s MiB | RSS end MiB | RSS max MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['latency_p50_ms']} | {r['latency_p99_ms']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
        f"{r['rss_mib_after_10s']} | {r['rss_mib_end']} | {r['rss_mib_max']} |",
        "",
        "Latency p50 of the requests sent in each third of the run (ms): "
        + ", ".join(str(x) for x in r["latency_p50_ms_by_third"]) + ".",
        "",
        f"Greedy probes (base model and adapter a0) unchanged over {len(r['probes'])} probes: "
        f"{'yes' if r['probe_unchanged'] else 'NO'} (the adapter's differs from the base model's: "
        f"{'yes' if r['probe_adapter_differs'] else 'no'}). "
        f"Adapter churn calls ({len(r['churns'])}): "
        + ", ".join(f"{x['action']} {x['status']}" for x in r["churns"]) + ". "
        f"At the end: {_end_words(r['end_state'])}. Server exit code after SIGTERM: {r['server_exit_code']}.",
        "",
        "RSS over time (s: MiB): " + ", ".join(f"{t:g}: {m:g}" for t, m in rss[::step]) + ".",
    ]
    if r["problems"]:
        lines += ["", "First problems: " + "; ".join(f"{p['kind']} {p['model']}: {p['detail']}" for p in r["problems"][:5])]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole soak: model and adapters, the server, the load, the report (also written to --out)."""
    work = Path(tempfile.mkdtemp(prefix="jlora-soak-"))
    try:
        model: str | None
        if args.model == "tiny":
            model = str(write_tiny_model(work / "tiny"))
        elif args.model == "default":
            model = None
        else:
            model = args.model
        root = work / "adapters"
        names = [p.name for p in write_adapters(model, root, args.adapters, args.lora_rank, args.seed)]
        t0 = time.perf_counter()
        proc, base_url = start_server(model, root, names, args, work / "server.log")
        start_s = time.perf_counter() - t0
        print(f"soak: jlora serve (pid {proc.pid}) ready in {start_s:.1f} s at {base_url}; {args.duration:g} s at "
              f"{args.rate:g} req/s", flush=True)
        try:
            import httpx

            base_model = httpx.get(base_url + "/v1/models", trust_env=False, timeout=30).json()["data"][0]["id"]
            soak = Soak(base_url, proc.pid, base_model, names[:-1], root, args)
            asyncio.run(soak.run())
        finally:
            exit_code = stop_server(proc)
        result = summarize(soak, args, exit_code, start_s)
        if exit_code != 0 or result["lost"]:
            result["server_log_tail"] = (work / "server.log").read_text(errors="replace")[-4000:]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(result, indent=1))
        (out / "soak.md").write_text(format_markdown(result))
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jlora bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (a random 2-layer Llama, written here), default "
                                                  "(SmolLM2-135M-Instruct), or a checkpoint path")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rate", type=float, default=2.0, help="request arrivals per second (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--adapters", type=int, default=3, help="adapters served throughout (plus the churn one)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32, help="each request asks for 4 to this many tokens")
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--walk-away", type=float, default=0.2, help="fraction of streams left after 1-3 chunks")
    p.add_argument("--churn-every", type=float, default=10.0, help="seconds between unloading and reloading")
    p.add_argument("--probe-every", type=float, default=10.0, help="seconds between greedy probes")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request without an answer by then is lost")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=64)
    p.add_argument("--max-loras", type=int, default=2, help="device slots (fewer than the adapters: they rotate)")
    p.add_argument("--token-buckets", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write soak.json and soak.md here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.rate > 0 and math.isfinite(args.rate)) or args.duration <= 0:
        raise SystemExit("--rate and --duration must be positive")
    result = run(args)
    print(format_markdown(result), end="")
    ok = (result["lost"] == 0 and result["http_5xx"] == 0 and result["rejected"] == 0 and result["probe_unchanged"]
          and all(s == 200 for s in result["churn_statuses"]) and result["server_exit_code"] == 0
          and result["end_state"].get("idle", False))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
