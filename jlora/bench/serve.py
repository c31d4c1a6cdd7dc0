"""`jlora bench serve`: the HTTP server under Poisson load, measured like vLLM's serving benchmark.

Starts `jlora serve` in this process on 127.0.0.1 (a free port) with the demo adapters, then for each
request rate sends N streaming chat requests whose arrival gaps are exponential (rate `inf` sends
them all at once), each for the base model or one of the adapters in turn. Per rate it reports
request and output-token throughput and the p50/p99 of time to first token (TTFT), time per output
token after the first (TPOT) and end-to-end latency. EOS is ignored, so every request generates
exactly --max-tokens tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import threading
import time
from pathlib import Path

import numpy as np

DEMO_ADAPTERS = ("digit-seven", "all-caps", "pirate")
QUESTIONS = [
    "How many legs does a spider have?", "Name a color of the sky.", "What do bees make?",
    "Give me a word that rhymes with cat.", "What is the capital of France?", "How do you greet a friend?",
    "What is two plus five?", "Describe the sea in one sentence.", "What fruit is yellow and long?",
    "Why do we sleep?", "Tell me about the moon.", "What is your favourite number?",
]


@dataclasses.dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _one(client, model: str, question: str, max_tokens: int) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"{r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # counted as a failed request, as vLLM's benchmark does
        return Result(False, error=repr(e))
    latency = time.perf_counter() - t0
    return Result(True, latency if ttft is None else ttft, latency, tokens)


async def _run_rate(base_url: str, rate: float, jobs: list[tuple[str, str]], max_tokens: int,
                    seed: int) -> tuple[list[Result], float]:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, trust_env=False,
                                 limits=httpx.Limits(max_connections=len(jobs) + 8)) as client:
        tasks = []
        t0 = time.perf_counter()
        for model, question in jobs:
            tasks.append(asyncio.create_task(_one(client, model, question, max_tokens)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def summarize(rate: float, results: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return {
        "rate": rate, "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "req_per_s": len(ok) / duration, "out_tok_per_s": sum(r.output_tokens for r in ok) / duration,
        "ttft_p50_ms": _pct([r.ttft for r in ok], 50), "ttft_p99_ms": _pct([r.ttft for r in ok], 99),
        "tpot_p50_ms": _pct(tpots, 50), "tpot_p99_ms": _pct(tpots, 99),
        "e2e_p50_ms": _pct([r.latency for r in ok], 50), "e2e_p99_ms": _pct([r.latency for r in ok], 99),
    }


def format_table(rows: list[dict[str, float]]) -> str:
    head = ("| request rate (req/s) | completed | duration s | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms "
            "| TPOT p50 ms | TPOT p99 ms | e2e p50 ms | e2e p99 ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        rate = "inf" if math.isinf(r["rate"]) else f"{r['rate']:g}"
        lines.append(f"| {rate} | {r['completed']}/{r['completed'] + r['failed']} | {r['duration_s']:.1f} | "
                     f"{r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.0f} | {r['tpot_p99_ms']:.0f} | "
                     f"{r['e2e_p50_ms']:.0f} | {r['e2e_p99_ms']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--adapters-dir", default="adapters", help="holds the demo adapters " + ", ".join(DEMO_ADAPTERS))
    p.add_argument("--rates", default="1,4,inf", help="comma-separated request rates (req/s); inf = all at once")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=4, help="device adapter slots (below 3, the demo adapters "
                                                             "take turns)")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--token-buckets", default="32,256")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from jlora import LLM, compile_stats
    from jlora.models.loading import DEFAULT_MODEL
    from jlora.server.app import build_app
    from jlora.server.serve import bind, engine_kwargs, make_server

    rates = [float(x) for x in args.rates.split(",")]
    lora_modules = {n: str(Path(args.adapters_dir) / n) for n in DEMO_ADAPTERS}
    t0 = time.perf_counter()
    flags = {k: v for k, v in vars(args).items() if k not in ("num_requests", "rates", "seed", "max_tokens")}
    llm = LLM(args.model, **engine_kwargs(flags))
    model_id = args.model or DEFAULT_MODEL
    app = build_app(llm, model_id, lora_modules=lora_modules)
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    sock = bind("127.0.0.1", 0)
    server = make_server(app, "127.0.0.1", 0, shutdown_timeout=5, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    served = app.state.server.adapters  # the app lets go of its server when it stops
    models = [model_id, *DEMO_ADAPTERS]
    jobs = [(models[i % len(models)], QUESTIONS[i % len(QUESTIONS)]) for i in range(args.num_requests)]
    try:
        asyncio.run(_run_rate(base_url, math.inf, jobs[:4], 4, args.seed))  # first-request costs out of the way
        compiles = compile_stats.compile_count()
        rows = []
        for rate in rates:
            results, duration = asyncio.run(_run_rate(base_url, rate, jobs, args.max_tokens, args.seed))
            rows.append(summarize(rate, results, duration))
            errors = [r.error for r in results if not r.ok]
            print(f"rate {rate:g}: {len(results) - len(errors)}/{len(results)} ok in {duration:.1f}s"
                  + (f"; first error: {errors[0]}" if errors else ""), flush=True)
        new_compiles = compile_stats.compile_count() - compiles
    finally:
        server.should_exit = True
        thread.join(60)
    # The same requests offline (LLM.chat, everything queued at once): what the HTTP layer costs.
    from jlora import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for _, q in jobs], params,
                    [served.get(m) for m, _ in jobs], use_tqdm=False)
    offline_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t1)
    stats = llm.engine.adapters.stats
    print(f"\n{args.num_requests} requests per rate, {args.max_tokens} output tokens each (EOS ignored), greedy; "
          f"models round-robin over {models}; max_loras={args.max_loras}, max_num_seqs={args.max_num_seqs}, "
          f"max_model_len={args.max_model_len}.\n")
    print(format_table(rows))
    inf_row = next((r for r in rows if math.isinf(r["rate"])), None)
    if inf_row:
        print(f"\nOffline LLM.chat on the same {len(jobs)} requests: {offline_tps:.1f} output tok/s; the server at "
              f"rate inf reaches {inf_row['out_tok_per_s'] / offline_tps:.2f}x of it.")
    print(f"\nXLA compilations during the run: {new_compiles}. Adapter slot hits {stats['slot_hits']}, "
          f"loads into a slot {stats['slot_writes']}, evictions {stats['evictions']}; preemptions "
          f"{llm.engine.num_preemptions}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
