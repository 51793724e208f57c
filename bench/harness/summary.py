"""From generation records to numbers (`summarize`) and from a run record to SUMMARY.md.

Everything here is recomputable from generations.jsonl alone: `summarize(records)` over the
file's lines gives run.json's "summary" exactly. Medians are statistics.median; spreads are
the 25th and 75th percentiles (linear interpolation between ranks), min and max.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"n": len(values), "median": statistics.median(values), "p25": quantile(values, 0.25),
            "p75": quantile(values, 0.75), "min": min(values), "max": max(values)}


def decode_tok_s(r: dict) -> float | None:
    times = r["event_times_s"]
    if r["completion_tokens"] is None or r["completion_tokens"] < 2 or len(times) < 2 or times[-1] <= times[0]:
        return None
    return (r["completion_tokens"] - 1) / (times[-1] - times[0])


def group_key(r: dict) -> str:
    return f"{r['arm']}|{r['workload']}|c{r['concurrency']}|t{r['turn']}"


def summarize(records: list[dict]) -> dict:
    """Per (arm, workload, concurrency, turn): the measured generations' spreads."""
    groups, warm = defaultdict(list), defaultdict(list)
    for r in records:
        if r["error"] is None and r["phase"] in ("measured", "warmup"):
            (groups if r["phase"] == "measured" else warm)[group_key(r)].append(r)
    return {key: _group(rs, warm.get(key, [])) for key, rs in sorted(groups.items())}


def _group(rs: list[dict], warmups: list[dict]) -> dict:
    itl = [b - a for r in rs for a, b in zip(r["event_times_s"], r["event_times_s"][1:])]
    rounds = defaultdict(list)
    for r in rs:
        rounds[(r["block"], r["rep"])].append(r)
    round_tok_s = [sum(r["completion_tokens"] or 0 for r in rr)
                   / (max(r["t_start_s"] + r["e2e_s"] for r in rr) - min(r["t_start_s"] for r in rr))
                   for rr in rounds.values()]
    sessions = defaultdict(list)
    for r in rs:
        sessions[r["session"]].append(r)
    first = rs[0]
    return {
        "arm": first["arm"], "workload": first["workload"], "concurrency": first["concurrency"],
        "turn": first["turn"], "n": len(rs),
        "ttft_s": spread([r["ttft_s"] for r in rs if r["ttft_s"] is not None]),
        "decode_tok_s": spread([v for v in map(decode_tok_s, rs) if v is not None]),
        "itl_s": {"n": len(itl), "median": statistics.median(itl), "p90": quantile(itl, 0.9),
                  "p99": quantile(itl, 0.99)} if itl else None,
        "e2e_s": spread([r["e2e_s"] for r in rs]),
        "prefill_tok_s": spread([r["prompt_tokens"] / r["ttft_s"] for r in rs
                                 if r["prompt_tokens"] and r["ttft_s"]]),
        "round_tok_s": spread(round_tok_s),
        "prompt_tokens": _range([r["prompt_tokens"] for r in rs]),
        "cached_tokens": _range([r.get("cached_tokens") for r in rs]),
        "cache_hit_rate": cache_hit_rate(rs),
        "completion_tokens": _range([r["completion_tokens"] for r in rs]),
        "events_per_generation": _range([len(r["event_times_s"]) for r in rs]),
        "by_session": {str(s): {"n": len(v), "ttft_s_median": _median([r["ttft_s"] for r in v]),
                                "decode_tok_s_median": _median([decode_tok_s(r) for r in v])}
                       for s, v in sorted(sessions.items())},
        "warmup": {"n": len(warmups), "ttft_s_median": _median([r["ttft_s"] for r in warmups])},
    }


def cache_hit_rate(rs: list[dict]) -> float | None:
    """Prompt tokens the server's prefix cache served / prompt tokens, over the generations
    whose usage says (None: the server does not report cached tokens)."""
    known = [r for r in rs if r.get("cached_tokens") is not None and r["prompt_tokens"]]
    return sum(r["cached_tokens"] for r in known) / sum(r["prompt_tokens"] for r in known) if known else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _range(values) -> list | None:
    values = [v for v in values if v is not None]
    return [min(values), max(values)] if values else None


# -- SUMMARY.md ------------------------------------------------------------------------------
def _ms(s: dict | None, key: str = "median") -> str:
    return "-" if not s else f"{1e3 * s[key]:.2f}"


def _sp(s: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    if not s:
        return "-"
    return f"{scale * s['median']:.{digits}f} [{scale * s['p25']:.{digits}f}-{scale * s['p75']:.{digits}f}]"


def render(run: dict) -> str:
    v = run["verdict"]
    out = [f"# FreeToken benchmark {run['run_id']}: {v['status']}, {v['validity']}", "",
           f"Status **{v['status']}** ({v['observed_generations']} of {v['expected_generations']} expected "
           f"generations observed{', interrupted' if v['interrupted'] else ''}"
           f"{', refused before measuring' if v['refused'] else ''}"
           f"{', aborted: ' + v['aborted'] if v['aborted'] else ''}). Validity **{v['validity']}**.", ""]
    if v["validity"] == "INVALID":
        out += ["**INVALID: a precondition of this benchmark failed. Do not compare or publish these "
                "numbers.**", ""]
    elif v["validity"] == "NON_CANONICAL":
        out += ["**NON_CANONICAL: this run departs from the frozen manifest or its protocol; its numbers "
                "are not canonical results.**", ""]
    if v["reasons"]:
        out += ["## Reasons", ""] + [f"- `{r['code']}` [{r['severity']}{', overridden' if r['overridden'] else ''}]"
                                     f"{_where(r)}: {r['detail']}" for r in v["reasons"]] + [""]
    out += _results(run) + _conditions(run)
    return "\n".join(out) + "\n"


def _where(r: dict) -> str:
    parts = [f"{k} {r[k]}" for k in ("arm", "workload") if r.get(k)]
    return f" ({', '.join(parts)})" if parts else ""


def _results(run: dict) -> list[str]:
    out = ["## Results", "",
           "Measured generations only; warmups are in generations.jsonl, tagged `warmup`. TTFT: request "
           "start to the first SSE event carrying text. Decode: (output tokens - 1) / (last event - first "
           "event), per generation. Round: all tokens of one round / its wall time. Cached: the prompt "
           "tokens the server's prefix cache served (usage.prompt_tokens_details.cached_tokens) over all "
           "prompt tokens. Cells: median [p25-p75].", "",
           "| arm | workload | conc | turn | n | TTFT ms | decode tok/s | ITL ms p50 / p90 / p99 | e2e s "
           "| round tok/s | prompt tok | output tok | cached |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in run["summary"].values():
        itl = g["itl_s"]
        itl_cell = "-" if not itl else f"{_ms(itl)} / {_ms(itl, 'p90')} / {_ms(itl, 'p99')}"
        out.append(f"| {g['arm']} | {g['workload']} | {g['concurrency']} | {g['turn']} | {g['n']} | "
                   f"{_sp(g['ttft_s'], 1e3)} | {_sp(g['decode_tok_s'], 1, 1)} | {itl_cell} | "
                   f"{_sp(g['e2e_s'], 1, 3)} | {_sp(g['round_tok_s'], 1, 1)} | "
                   f"{_span(g['prompt_tokens'])} | {_span(g['completion_tokens'])} | "
                   f"{_pct(g.get('cache_hit_rate'))} |")
    if not run["summary"]:
        out.append("| (no measured generations) ||||||||||||| ")
    return out + [""] + _ttft_by_turn(run)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _ttft_by_turn(run: dict) -> list[str]:
    """Multi-turn workloads: median TTFT per turn, an arm per column, and each arm's speedup
    over the first arm's (so arms that differ in one flag, e.g. prefix caching, compare per turn)."""
    groups = [g for g in run["summary"].values() if g["ttft_s"]]
    multi = sorted({(g["workload"], g["concurrency"]) for g in groups if g["turn"] > 0})
    out = []
    for workload, conc in multi:
        mine = [g for g in groups if g["workload"] == workload and g["concurrency"] == conc]
        arms = list(dict.fromkeys(g["arm"] for g in mine))
        cell = {(g["arm"], g["turn"]): g for g in mine}
        out += [f"### TTFT per turn: {workload}, concurrency {conc}", "",
                "| turn | " + " | ".join(f"{a} TTFT ms | {a} cached" for a in arms)
                + "".join(f" | {arms[0]} / {a}" for a in arms[1:]) + " |",
                "|---" * (1 + 2 * len(arms) + len(arms) - 1) + "|"]
        for turn in sorted({g["turn"] for g in mine}):
            row = [str(turn)]
            for a in arms:
                g = cell.get((a, turn))
                row += [_ms(g["ttft_s"]) if g else "-", _pct(g.get("cache_hit_rate")) if g else "-"]
            base = cell.get((arms[0], turn))
            for a in arms[1:]:
                g = cell.get((a, turn))
                row.append(f"{base['ttft_s']['median'] / g['ttft_s']['median']:.2f}x" if base and g else "-")
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return out


def _span(r: list | None) -> str:
    return "-" if not r else (str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}")


def _conditions(run: dict) -> list[str]:
    h, m, p = run["harness"], run["manifest"], run["protocol"]
    git = h["git"]
    host = h["host"]
    ram = f"{host['ram_bytes'] / 2**30:.1f} GiB" if host["ram_bytes"] else "unknown"
    out = ["## Conditions", "",
           f"- manifest: `{m['path']}` version {m['version']}, sha256 `{m['sha256'][:16]}`",
           f"- protocol: {p['warmups']} warmup + {p['measured']} measured per block, {p['sessions']} "
           f"session(s) (manifest: {p['manifest']['warmups']} + {p['manifest']['measured']}, "
           f"{p['manifest']['sessions']})",
           f"- FreeToken checkout: `{git['commit']}`"
           + (f" (dirty: {len(git['changed_files'])} changed files)" if git["dirty"] else ""),
           f"- host: {host['cpu']}, {host['usable_cpus']} of {host['logical_cpus']} CPUs usable, {ram} RAM, "
           f"Python {host['python']}, {host['platform']}",
           "- versions: " + ", ".join(f"{k} {v}" for k, v in h["versions"].items()),
           f"- GPUs (nvidia-smi): {h['gpus'] if h['gpus'] is not None else 'none (no nvidia-smi)'}"]
    for name, arm in run["arms"].items():
        prov = arm.get("provenance") or {}
        model = prov.get("model", {})
        out += ["", f"### arm `{name}` ({arm['describe']['kind']})", "",
                f"- {arm['describe']}",
                f"- model: {model.get('id') or model.get('path')}, config.json sha256 "
                f"`{(model.get('config_sha256') or 'unknown')[:16]}` (from {model.get('source', 'local files')})",
                f"- device: {prov.get('device')}", f"- versions: {prov.get('versions')}"]
        inst = prov.get("instrumentation")
        if inst is not None:
            out.append(f"- /v1/instrumentation: HTTP {inst['status']}")
        cfg = arm.get("config", {})
        if cfg.get("initial") is not None:
            out.append(f"- resolved configuration (sha256 `{cfg['sha256'][:16]}`): `{cfg['initial']}`")
        if prov.get("missing"):
            out.append(f"- missing provenance: {', '.join(prov['missing'])}")
    out += ["", "## Execution order", ""] + [f"    {line}" for line in run["plan_text"]]
    return out
