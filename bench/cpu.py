#!/usr/bin/env python3
"""The CPU engine against transformers and llama.cpp on the same weights, and against the
machine's DRAM read ceiling, in one run.

    python bench/cpu.py                                   # Qwen3-MoE-shaped, 1.4 GB bf16
    python bench/cpu.py --llama-bench /path/llama-bench   # + llama.cpp on a GGUF of them
    python bench/cpu.py --quick                           # a small shape, seconds
    python bench/cpu.py --quant fp8,nvfp4,int4 --llama-quant q8_0   # + quantized arms
    python bench/cpu.py --quant int4 --llama-quant q4_0,q4_0+head  # q4_0, and with a bf16 head
    python bench/cpu.py --unpacked                        # + FreeToken without CPU packing
    python bench/cpu.py --eager                           # + FreeToken without its decode program
    python bench/cpu.py --quant fp8 --lm-head-dtype int8  # + each arm with its lm_head in int8
    python bench/cpu.py --depth 16384                     # + batch 1 after a 16k-token prompt
    python bench/cpu.py --family qwen3_next               # the same shape, Qwen3-Next's layers

The checkpoint (tools/make_tiny_model.py's generator, random weights: hidden 1024, 12 layers,
16/4 heads of 64, 64 experts, top-8, expert width 256, vocab 32768) is built on the spot.
Decode is measured apart from prefill (a run of 1 + N tokens minus a run of 1, 64-token
prompts) at batch 1, 8 and 16 (and with --depth N at batch 1 after an N-token prompt, where
the context's keys and values are read every step); prefill as one 512-token prompt. The machine is shared (the
runs are noisy), so FreeToken, transformers and the DRAM probe (a float32 matrix-vector
product over a matrix far above the L3, with the same threads) run interleaved, --rounds
times; printed per figure: the median, and the ratios with their spread over rounds.
Roofline: active bytes per token (the dense weights read once per step, lm_head included, the
embedding row excluded, plus top_k experts per MoE layer) x tok/s / measured bandwidth.
llama.cpp: the GGUF comes from llama.cpp's own converter (convert_hf_to_gguf.py, found beside
the binary or given with --llama-convert); batch 1 and prefill from llama-bench, batch 8/16
from llama-batched-bench when it sits beside llama-bench.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# `python bench/cpu.py` puts bench/ first on sys.path, where bench/kernels.py would shadow
# the `kernels` package transformers imports when it finds one (transformers 5.x: an
# ImportError inside from_pretrained). This checkout's freetoken instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

SHAPES = {
    "qwen3-moe-1.4g": dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
                           head_dim=64, num_experts=64, top_k=8, moe_intermediate_size=256,
                           vocab_size=32768, max_position_embeddings=4096, norm_topk_prob=True),
    "quick": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                  num_experts=16, top_k=4, moe_intermediate_size=128, vocab_size=4096,
                  max_position_embeddings=2048, norm_topk_prob=True),
}
BATCHES = (1, 8, 16)
PROMPT = 64
PREFILL = 512
# Each --quant format's nearest llama.cpp type, for the paired ratio rows.
NEAREST_GGUF = {"fp8": "q8_0", "fp8-channel": "q8_0", "int4": "q4_0", "int4-awq": "q4_0",
                "nvfp4": "q4_0"}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rate(tokens: int, t_first: float, t_all: float) -> float:
    """Decode tok/s from a run of 1 token and one of 1 + N; nan where noise swamped it."""
    return tokens / (t_all - t_first) if t_all > t_first else float("nan")


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(11 + 7 * i + 13 * j) % vocab for j in range(length)] for i in range(batch)]


class FreeTokenArm:
    def __init__(self, model_dir, dtype, vocab, name="freetoken", depth=0, **kw):
        from freetoken import LLM, SamplingParams
        self.name = name
        self.sp = SamplingParams
        self.vocab = vocab
        longest = max(PREFILL, depth) + 64
        self.llm = LLM(str(model_dir), device="cpu", dtype=dtype, skip_tokenizer_init=True,
                       max_model_len=longest, kv_cache_tokens=16 * (PROMPT + 64) + longest,
                       max_prefill_length=PREFILL * 16, max_running_requests=16,
                       enable_prefix_caching=False, **kw)

    def _gen(self, prompts, n):
        return _seconds(lambda: self.llm.generate(
            prompts, self.sp(max_tokens=n, temperature=0, ignore_eos=True)))

    def decode(self, batch, tokens):
        prompts = _prompts(batch, PROMPT, self.vocab)
        self._gen(prompts, 2)                                     # warm
        return _rate(batch * tokens, min(self._gen(prompts, 1) for _ in range(2)),
                     self._gen(prompts, 1 + tokens))

    def prefill(self):
        prompt = _prompts(1, PREFILL, self.vocab)
        return PREFILL / min(self._gen(prompt, 1) for _ in range(2))

    def decode_at(self, depth, tokens):
        """Batch-1 decode after a prompt of `depth` tokens: the engine's steps after the first
        token, timed. (Two whole runs' difference, each prefilling the prompt again, gave
        347 tok/s at depth 8192, more than at depth 64: a prefill's own run-to-run spread at
        8k, ~1 s, is larger than 32 decode steps.)"""
        engine = self.llm.engine
        req = engine.add_request(_prompts(1, depth, self.vocab)[0],
                                 self.sp(max_tokens=1 + tokens, temperature=0, ignore_eos=True))
        while engine.has_work and not req.output_token_ids:     # the prompt, its first token
            engine.step()
        t0 = time.perf_counter()
        while engine.has_work:
            engine.step()
        return tokens / (time.perf_counter() - t0)


class TransformersArm:
    name = "transformers"

    def __init__(self, model_dir, dtype, vocab):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.vocab = vocab

    @torch.inference_mode()
    def _gen(self, ids, n):
        return _seconds(lambda: self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False))

    def decode(self, batch, tokens):
        ids = torch.tensor(_prompts(batch, PROMPT, self.vocab))
        self._gen(ids, 2)
        return _rate(batch * tokens, min(self._gen(ids, 1) for _ in range(2)),
                     self._gen(ids, 1 + tokens))

    @torch.inference_mode()
    def prefill(self):
        ids = torch.tensor(_prompts(1, PREFILL, self.vocab))
        self.model(ids)
        return PREFILL / min(_seconds(lambda: self.model(ids)) for _ in range(2))

    def decode_at(self, depth, tokens):
        ids = torch.tensor(_prompts(1, depth, self.vocab))
        return _rate(tokens, min(self._gen(ids, 1) for _ in range(2)), self._gen(ids, 1 + tokens))


def unpacked_arm(model_dir, dtype, vocab, name="freetoken-unpacked", depth=0) -> FreeTokenArm:
    """The same engine with the model runner's CPU packing skipped: every projection and
    expert is the loaded 16-bit tensor alone (torch's bf16 products, not the fp16-weight
    GEMM), INT4 weights and experts are decoded a tile at a time (dequant_cpu.py) rather than
    run through torch's int4 GEMM."""
    import freetoken.engine.model_runner as model_runner
    from freetoken.models.layers.moe import ExpertBank
    pack, pack_experts = model_runner.pack_for_cpu, ExpertBank.pack_cpu
    model_runner.pack_for_cpu = lambda model: 0
    ExpertBank.pack_cpu = lambda self, *args, **kwargs: 0
    try:
        return FreeTokenArm(model_dir, dtype, vocab, name=name, depth=depth)
    finally:
        model_runner.pack_for_cpu, ExpertBank.pack_cpu = pack, pack_experts


def active_bytes_per_token(model_dir, dtype) -> tuple[int, int]:
    """(bytes read per decode token at batch 1, total weight bytes), off the meta-built model."""
    from freetoken.models.loader import init_model
    model = init_model(model_dir, dtype)[0]
    blocks = model.moe_blocks()
    banks = {id(p) for b in blocks.values() for p in b.experts.bank().values()}
    total = dense = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        if id(p) not in banks and "embed_tokens" not in name:
            dense += nbytes
    experts = sum(b.top_k * b.experts.layout.expert_bytes for b in blocks.values())
    return dense + experts, total


# ---- llama.cpp -------------------------------------------------------------------------------

def gguf_of(model_dir: Path, convert: Path, outtype: str, out: Path) -> Path:
    # The random checkpoint's tokenizer is not one the converter knows by hash; llama-bench
    # feeds token ids, so the pre-tokenizer name is irrelevant: name it qwen2. (GLM's vocab
    # step looks for GLM's special tokens, which the tiny tokenizer has not: the generic one.)
    shim = ("import sys, runpy; root = sys.argv.pop(1); sys.path[:0] = [root, root + '/gguf-py']\n"
            "from conversion.base import TextModel\n"
            "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
            "TextModel._set_vocab_glm = TextModel._set_vocab_gpt2\n"
            "sys.argv[0] = root + '/convert_hf_to_gguf.py'\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", shim, str(convert.parent), str(model_dir), "--outfile",
                    str(out), "--outtype", outtype], check=True, capture_output=True)
    return out


CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0")   # its --outtype choices


def requantize(bench: Path, gguf: Path, qtype: str, out: Path, threads: int,
               head: str | None = None) -> Path:
    """llama-quantize (beside llama-bench) of a GGUF to `qtype`: the types the converter
    cannot write (q4_0 against INT4); head: the output layer's type (default: the tool's
    choice, q6_K beside q4_0)."""
    tool = bench.parent / "llama-quantize"
    if not tool.exists():
        raise SystemExit(f"--llama-quant {qtype} needs {tool} (cmake --build build --target "
                         f"llama-quantize)")
    keep = ["--output-tensor-type", head] if head else []
    subprocess.run([str(tool), *keep, str(gguf), str(out), qtype, str(threads)], check=True,
                   capture_output=True)
    return out


def llama_cpp(bench: Path, gguf: Path, threads: int, tokens: int, rounds: int,
              depth: int = 0) -> dict:
    base = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", str(rounds), "-o", "json",
            "--repack", "0"]     # the AMX q8_0 repack dies with SIGILL in some VMs
    out = {}
    runs = [("decode_b1", ["-p", "0", "-n", str(tokens)]),
            ("prefill", ["-p", str(PREFILL), "-n", "0"])]
    if depth:                    # its -d fills the context first, untimed
        runs.append((f"decode_b1_d{depth}", ["-p", "0", "-n", str(tokens), "-d", str(depth)]))
    for key, flags in runs:
        rows = json.loads(subprocess.run(base + flags, check=True, capture_output=True,
                                         text=True).stdout)
        out[key] = [float(s) for s in rows[0]["samples_ts"]]
    batched = bench.parent / "llama-batched-bench"
    if batched.exists():
        npl = ",".join(str(b) for b in BATCHES[1:])
        res = subprocess.run([str(batched), "-m", str(gguf), "-t", str(threads), "-c",
                              str(max(BATCHES) * (PROMPT + tokens + 8)), "-npp", str(PROMPT),
                              "-ntg", str(tokens), "-npl", npl, "--output-format", "jsonl",
                              "--no-repack"],       # as above (q8_0's repack: SIGSEGV here)
                             check=True, capture_output=True, text=True).stdout
        for line in res.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[f"decode_b{row['pl']}"] = [float(row["speed_tg"])]
    return out


def _find_convert(bench: Path) -> Path:
    for d in (bench.parent, *bench.parents):
        if (d / "convert_hf_to_gguf.py").exists():
            return d / "convert_hf_to_gguf.py"
    raise SystemExit(f"no convert_hf_to_gguf.py above {bench}: give --llama-convert")


# ---- the run ---------------------------------------------------------------------------------

def l3_bytes() -> int | None:
    """The largest cache's size (sysfs; None where it is not there)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        sizes.append(int(size.rstrip("KMG")) * unit)
    return max(sizes) if sizes else None


def _fmt(values) -> str:
    if not values:
        return "-"
    values = [v for v in values if v == v]           # nan: a run the noise swamped
    if not values:
        return "nan"
    med = statistics.median(values)
    return f"{med:.3g}" if len(values) == 1 else f"{med:.3g} [{min(values):.3g}-{max(values):.3g}]"


def _ratio(mine: list | None, other: list | None) -> str:
    """mine / other: per round with its spread when both ran the same rounds, else medians."""
    if not mine or not other:
        return "-"
    if len(mine) == len(other):
        return _fmt([a / b for a, b in zip(mine, other)])
    return _fmt([statistics.median(mine) / statistics.median(other)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small shape, fewer tokens")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--family", default="qwen3_moe", help="make_tiny_model's family at the "
                   "bench shape (qwen3_next: 3 in 4 layers Gated DeltaNet)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every arm")
    p.add_argument("--decode-tokens", type=int, default=None, help="default 32 (--quick 8)")
    p.add_argument("--dram-gib", type=float, default=1.0, help="the probe's matrix size")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--llama-bench", type=Path, help="a llama-bench binary: adds llama.cpp")
    p.add_argument("--llama-convert", type=Path, help="convert_hf_to_gguf.py (default: above the binary)")
    p.add_argument("--quant", default="", help="comma-separated make_tiny_model --quant formats: "
                   "a FreeToken arm each (qwen3_moe: fp8, fp8-channel, nvfp4, int4, int4-awq)")
    p.add_argument("--llama-quant", default="", help="comma-separated GGUF types for llama.cpp "
                   "arms beside --dtype's (the converter's --outtype: q8_0; others, q4_0, "
                   "through llama-quantize beside llama-bench); TYPE+head keeps the output "
                   "layer in --dtype, as FreeToken's quantized checkpoints keep lm_head "
                   "(llama-quantize's default makes it q6_K)")
    p.add_argument("--unpacked", action="store_true", help="add FreeToken arms without the "
                   "CPU packing (fp16 projections, INT4 GEMM): one beside each packed arm")
    p.add_argument("--eager", action="store_true", help="add FreeToken arms with enforce_eager "
                   "(the modules at every decode step, not the native decode program): one "
                   "beside each arm")
    p.add_argument("--lm-head-dtype", choices=("int8",), help="add FreeToken arms with "
                   "this lm_head_dtype (the output layer read in 8 bits with a scale a row, as "
                   "llama.cpp's q8_0 quantizes it): '-int8head' beside each arm, the quantized "
                   "ones paired with llama.cpp's nearest type's default")
    p.add_argument("--depth", type=int, default=0, help="also decode at batch 1 after a prompt "
                   "of this many tokens (decode_b1_dN: a long context's attention; each "
                   "FreeToken and transformers run prefills it again)")
    p.add_argument("--workdir", help="where to write the model (default: a temp folder)")
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args(argv)
    tokens = args.decode_tokens or (8 if args.quick else 32)
    if args.lm_head_dtype and args.dtype == "float32":
        p.error("--lm-head-dtype is a 16-bit model's (the engine refuses it in float32)")
    shape = SHAPES["quick" if args.quick else "qwen3-moe-1.4g"]
    torch.set_num_threads(args.threads)
    from freetoken.demo.tiny_model import make_tiny_model
    from freetoken.moe.bandwidth import host_read_gbps

    report = {"conditions": {**vars(args), "shape": shape, "decode_tokens": tokens}}
    quants = [q for q in args.quant.split(",") if q]
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)   # a new folder: made, not a traceback
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model_dir = Path(tmp) / "model"
        make_tiny_model(model_dir, family=args.family, seed=0, dtype=args.dtype, **shape)
        active, total = active_bytes_per_token(model_dir, args.dtype)
        report.update(active_bytes_per_token=active, weight_bytes=total)
        actives = {"freetoken": active}
        totals = {"freetoken": total}
        arms = [FreeTokenArm(model_dir, args.dtype, shape["vocab_size"], depth=args.depth)]
        # lm_head in 8 bits: its 2-byte weights read as 1 byte and a float32 scale a row
        head = shape["hidden_size"] * shape["vocab_size"]
        saved = head * 2 - head - 4 * shape["vocab_size"]
        kind = args.lm_head_dtype
        if kind:
            arms.append(FreeTokenArm(model_dir, args.dtype, shape["vocab_size"],
                                     name=f"freetoken-{kind}head", lm_head_dtype=kind,
                                     depth=args.depth))
            actives[f"freetoken-{kind}head"] = active - saved
        if args.unpacked:
            arms.append(unpacked_arm(model_dir, args.dtype, shape["vocab_size"], depth=args.depth))
            actives["freetoken-unpacked"] = active
        if args.eager:
            arms.append(FreeTokenArm(model_dir, args.dtype, shape["vocab_size"],
                                     name="freetoken-eager", enforce_eager=True, depth=args.depth))
            actives["freetoken-eager"] = active
        for q in quants:
            from freetoken.models.quant.encode import quantize_checkpoint
            qdir = Path(tmp) / f"model-{q}"
            shutil.copytree(model_dir, qdir)
            quantize_checkpoint(qdir, q)
            actives[f"freetoken-{q}"], totals[f"freetoken-{q}"] = active_bytes_per_token(
                qdir, args.dtype)
            arms.append(FreeTokenArm(qdir, args.dtype, shape["vocab_size"], name=f"freetoken-{q}",
                                     depth=args.depth))
            if kind:
                arms.append(FreeTokenArm(qdir, args.dtype, shape["vocab_size"],
                                         name=f"freetoken-{q}-{kind}head", lm_head_dtype=kind,
                                         depth=args.depth))
                actives[f"freetoken-{q}-{kind}head"] = actives[f"freetoken-{q}"] - saved
            if args.unpacked:
                arms.append(unpacked_arm(qdir, args.dtype, shape["vocab_size"],
                                         name=f"freetoken-{q}-unpacked", depth=args.depth))
                actives[f"freetoken-{q}-unpacked"] = actives[f"freetoken-{q}"]
            if args.eager:
                arms.append(FreeTokenArm(qdir, args.dtype, shape["vocab_size"],
                                         name=f"freetoken-{q}-eager", enforce_eager=True,
                                         depth=args.depth))
                actives[f"freetoken-{q}-eager"] = actives[f"freetoken-{q}"]
        if not args.skip_transformers:
            arms.append(TransformersArm(model_dir, args.dtype, shape["vocab_size"]))
        figures = [f"decode_b{b}" for b in BATCHES] + ["prefill"]
        if args.depth:
            figures.append(f"decode_b1_d{args.depth}")
        res = {a.name: {f: [] for f in figures} for a in arms}
        dram = []
        for _ in range(args.rounds):           # interleaved: each round runs every arm once
            dram.append(host_read_gbps(args.threads, args.dram_gib))
            for f in figures:
                for a in arms:
                    res[a.name][f].append(
                        a.prefill() if f == "prefill"
                        else a.decode_at(args.depth, tokens) if "_d" in f
                        else a.decode(int(f[8:]), tokens))
                    print(f"  {a.name} {f}: {res[a.name][f][-1]:.3g} tok/s", file=sys.stderr,
                          flush=True)
        dram.append(host_read_gbps(args.threads, args.dram_gib))
        del arms
        if args.llama_bench:
            convert = args.llama_convert or _find_convert(args.llama_bench)
            base = {"bfloat16": "bf16", "float32": "f32"}[args.dtype]
            ggufs = {}
            for outtype in [base] + [t for t in args.llama_quant.split(",") if t]:
                name = "llama.cpp" if outtype == base else f"llama.cpp-{outtype}"
                out = Path(tmp) / f"model-{outtype}.gguf"
                qtype, head = (outtype[:-len("+head")], base) if outtype.endswith("+head") \
                    else (outtype, None)
                try:
                    if outtype in CONVERTER_TYPES:
                        ggufs[outtype] = gguf_of(model_dir, convert, outtype, out)
                    elif base in ggufs:        # q4_0, q4_k_m, ...: llama-quantize of base's
                        ggufs[outtype] = requantize(args.llama_bench, ggufs[base], qtype,
                                                    out, args.threads, head)
                    else:
                        continue
                except subprocess.CalledProcessError as exc:   # (its converter may not take
                    err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr
                    print(f"{name}: no GGUF of this checkpoint: {exc.cmd[-4:]} failed: "
                          f"{(err or '').strip()[-400:]}", file=sys.stderr)    # the family)
                    continue
                try:
                    res[name] = llama_cpp(args.llama_bench, ggufs[outtype], args.threads,
                                          tokens, args.rounds, args.depth)
                except subprocess.CalledProcessError as exc:   # one arm lost, not the run
                    print(f"{name}: {exc} {(exc.stderr or '')[-300:]}", file=sys.stderr)
    from triton_kernels.cpu_native import native_kernels
    native = native_kernels()
    forms = native.forms() if native is not None else None
    report.update(active_bytes_per_arm=actives, native_forms=forms)
    report.update(dram_read_gbps=dram, results=res)

    bw = statistics.median(dram)
    print(f"weights {total / 1e9:.2f} GB ({args.dtype}), active per token {active / 1e9:.3f} GB; "
          f"DRAM read {_fmt(dram)} GB/s with {args.threads} threads; {tokens} decode tokens, "
          f"{args.rounds} rounds (median [min-max])")
    if forms:
        print(f"FreeToken's native kernels here: {forms}")
    width = max(len(n) for n in res) + 6
    print("tok/s".ljust(width) + "".join(f.ljust(24) for f in figures) + "b1 roofline")
    for name, r in res.items():
        b1 = r.get("decode_b1") or []
        b1 = [v for v in b1 if v == v]
        nbytes = actives.get(name, active)       # llama.cpp's quantized arms: not counted
        roof = (f"{statistics.median(b1) * nbytes / 1e9 / bw:.0%}"
                if b1 and (name in actives or "-" not in name) else "-")
        print(name.ljust(width) + "".join(_fmt(r.get(f)).ljust(24) for f in figures) + roof)
    for name in actives:
        if name != "freetoken":
            print(f"{name}: {actives[name] / 1e9:.3f} GB active per token")
    # A model whose weights fit in the last-level cache decodes partly from it: its roofline
    # (a DRAM figure) then reads low for a kernel that is compute-bound, not slow to stream.
    l3 = l3_bytes()
    cached = [name for name in totals if l3 and totals[name] <= l3]
    if cached:
        print(f"within this CPU's {l3 / 2**20:.0f} MiB last-level cache: "
              + ", ".join(f"{name} ({totals[name] / 1e9:.2f} GB of weights)" for name in cached)
              + ": their b1 roofline is against DRAM, which they do not only read")
    report.update(weight_bytes_per_arm=totals, llc_bytes=l3)
    # The bf16 engine against every arm, then each quantized arm against llama.cpp's nearest
    # type (FP8 against q8_0, 4-bit against q4_0: #21's pairs).
    pairs = [("freetoken", other) for other in res if other != "freetoken"]
    pairs += [(f"freetoken-{q}", f"llama.cpp-{NEAREST_GGUF[q]}{head}") for q in quants
              for head in ("", "+head") if q in NEAREST_GGUF and f"freetoken-{q}" in res
              and f"llama.cpp-{NEAREST_GGUF[q]}{head}" in res]
    pairs += [(f"freetoken-{q}-{args.lm_head_dtype}head", f"llama.cpp-{NEAREST_GGUF[q]}")
              for q in quants if q in NEAREST_GGUF
              and f"freetoken-{q}-{args.lm_head_dtype}head" in res
              and f"llama.cpp-{NEAREST_GGUF[q]}" in res]
    pairs += [(f"freetoken-{q}", f"freetoken-{q}-eager") for q in quants
              if f"freetoken-{q}-eager" in res]
    labels = [f"ft/{other}" if mine == "freetoken" else f"{mine}/{other}" for mine, other in pairs]
    width = max([width] + [len(label) + 2 for label in labels])
    for (mine, other), label in zip(pairs, labels):
        print(label.ljust(width) + "".join(_ratio(res[mine].get(f), res[other].get(f)).ljust(24)
                                           for f in figures))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
