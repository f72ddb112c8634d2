"""How compressible are DiLoCo's pseudo-gradients? Energy kept by each compressor at its bytes.

Trains the GPT task's model on N replicas simulated in one process (Muon or AdamW inner
steps, plain averaging every H steps: DiLoCo with an fp32 exchange and outer lr 1.0) and, at
every sync, compresses each replica's pseudo-gradient (``global - local`` of every matrix whose
sides are multiples of 64) with each compressor below. For each it reports:

- ``kept``: the share of a replica's pseudo-gradient energy the compressor keeps,
  ``1 - |x - C(x)|^2 / |x|^2``, and the same on Gaussian noise of the same shapes (``kept on
  noise``: a compressor that keeps no more than that finds no structure to exploit);
- ``mean kept``: how close the mean of the replicas' compressed pseudo-gradients comes to the
  fp32 mean that full-precision DiLoCo applies, ``1 - |mean C(x_r) - mean x_r|^2 / |mean x_r|^2``
  (one sync, no error feedback);
- bytes per parameter per sync, as the exchange would send them.

It also reports the cosine between two replicas' pseudo-gradients and the energy of their mean
relative to theirs (1/N for independent noise, 1 for one shared direction). Prints a table per
batch size and writes ``compressibility.json``::

    python benchmarks/bench_compressibility.py                      # mini GPT, batch 8 and 64
    python benchmarks/bench_compressibility.py --optimizer adamw --batches 8
    python benchmarks/bench_compressibility.py --batches 8 --steps 90 --model tiny
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from flexdemo import SimulatedReplicas
from flexdemo.app.args import Parser
from flexdemo.app.tasks import GPT, get_batch, gpt_config, load_corpus
from flexdemo.compress import ValueCodec, dct_matrix

TILE = 64  # the sparse exchange's 64 x 64 blocks
INDEX_BITS = 12  # a position in a block of 4096


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """The 64 x 64 tiles of ``x`` as ``(tiles, 64, 64)``."""
    m, n = x.shape
    return x.reshape(m // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(-1, TILE, TILE)


def _untile(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    m, n = shape
    return t.reshape(m // TILE, n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(m, n)


def _topk_rows(z: torch.Tensor, k: int) -> torch.Tensor:
    """``z`` (rows) with all but each row's ``k`` largest magnitudes set to zero."""
    idx = z.abs().topk(k, dim=1).indices
    return torch.zeros_like(z).scatter_(1, idx, z.gather(1, idx))


def top_k(x: torch.Tensor, k: int, dct: bool) -> torch.Tensor:
    """The top ``k`` of each 64 x 64 block (of DCT coefficients when ``dct``), values exact."""
    t = _tiles(x)
    if dct:
        d = dct_matrix(TILE)
        t = d @ t @ d.T
    kept = _topk_rows(t.reshape(len(t), -1), k).reshape(t.shape)
    if dct:
        kept = d.T @ kept @ d
    return _untile(kept, x.shape)


def codebook(x: torch.Tensor, bits: int, block: int = 256) -> torch.Tensor:
    """``x`` coded dense with the statistical codebook (``stat1``/``stat2``) per block, by the
    dense exchanges' own codec."""
    codec, n = ValueCodec(f"stat{bits}", block=block), x.numel()
    buf = torch.empty(codec.nbytes(n), dtype=torch.uint8)
    codec.encode(x.reshape(-1).float().contiguous(), buf)
    return codec.decode(buf, n).view(x.shape)


def subset(x: torch.Tensor, share: float, bits: int, gen: torch.Generator) -> torch.Tensor:
    """A random ``share`` of the entries (one shared draw: no indices sent), coded with the
    statistical codebook per block of 256 of them; the rest zero."""
    flat = x.reshape(-1)
    n = int(round(share * flat.numel() / 256)) * 256
    idx = torch.randperm(flat.numel(), generator=gen)[:n]
    out = torch.zeros_like(flat)
    out[idx] = codebook(flat[idx], bits)
    return out.reshape(x.shape)


def low_rank(x: torch.Tensor, r: int) -> torch.Tensor:
    """The best rank-``r`` approximation (truncated SVD), values exact."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r]


SUBSET_SHARE = (64 * (2 + INDEX_BITS) / 8 + 8) / 4096 / (256 / 8 + 4) * 256
# name -> (compress(x, gen), bytes per parameter per sync of an m x n matrix)
COMPRESSORS = {
    "DCT top-64 of 4096 (sparseloco)": (lambda x, g: top_k(x, 64, True),
                                        lambda m, n: (64 * (2 + INDEX_BITS) / 8 + 8) / 4096),
    "DCT top-256 of 4096": (lambda x, g: top_k(x, 256, True),
                            lambda m, n: (256 * (2 + INDEX_BITS) / 8 + 8) / 4096),
    "plain top-64 of 4096": (lambda x, g: top_k(x, 64, False),
                             lambda m, n: (64 * (2 + INDEX_BITS) / 8 + 8) / 4096),
    "random shared subset, stat1 (top-64's bytes)": (
        lambda x, g: subset(x, SUBSET_SHARE, 1, g),
        lambda m, n: SUBSET_SHARE * (256 / 8 + 4) / 256),
    "rank 1 (bf16)": (lambda x, g: low_rank(x, 1), lambda m, n: 2 * (m + n) / (m * n)),
    "rank 4 (bf16)": (lambda x, g: low_rank(x, 4), lambda m, n: 8 * (m + n) / (m * n)),
    "dense stat1 (block 256)": (lambda x, g: codebook(x, 1), lambda m, n: (256 / 8 + 4) / 256),
    "dense stat2 (block 256)": (lambda x, g: codebook(x, 2), lambda m, n: (256 / 4 + 8) / 256),
}


def _energy(xs: list[torch.Tensor]) -> float:
    return float(sum(x.double().pow(2).sum() for x in xs))


def run(model: str, batch: int, replicas: int, steps: int, h: int, lr: float,
        seed: int, optimizer: str = "muon", corpus_bytes: int = 4_000_000) -> dict:
    """Train ``steps`` steps on ``batch`` sequences per replica; measure every sync after the
    first."""
    cfg = gpt_config(model)
    train, _ = load_corpus(corpus_bytes)
    torch.manual_seed(seed)
    sim = SimulatedReplicas(lambda: GPT(cfg), lambda m, b: m(*b), replicas=replicas,
                            replicator="none", optimizer=optimizer, lr=lr, seed=seed,
                            **({"base_kwargs": {"ns_dtype": "fp32"}} if optimizer == "muon"
                               else {}))
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(replicas)]
    pick = [i for i, p in enumerate(sim.models[0].parameters())  # the tiled matrices
            if p.ndim == 2 and p.shape[0] % TILE == 0 and p.shape[1] % TILE == 0]
    start = [p.detach().clone() for p in sim.models[0].parameters()]
    cgen = torch.Generator().manual_seed(seed)
    sums: dict[str, dict[str, float]] = {c: {"kept": 0.0, "noise": 0.0, "mean": 0.0}
                                         for c in COMPRESSORS}
    stats = {"cos": [], "mean_share": []}
    energy = {"x": 0.0, "noise": 0.0, "mean": 0.0}

    def sync(done: int, losses) -> bool:
        if done % h:
            return False
        params = [list(m.parameters()) for m in sim.models]
        with torch.no_grad():
            deltas = [[g - p for g, p in zip(start, ps)] for ps in params]
            mean = [torch.stack(d).mean(0) for d in zip(*deltas)]
            if done > h:  # the first period starts from the initialisation: skip it
                record(deltas, mean)
            for ps in params:
                for g, p, d in zip(start, ps, mean):
                    p.copy_(g - d)
            for g, d in zip(start, mean):
                g.sub_(d)
        return False

    def record(deltas, mean) -> None:
        xs = [[d[i] for i in pick] for d in deltas]
        ms = [mean[i] for i in pick]
        a, b = torch.cat([x.reshape(-1) for x in xs[0]]), torch.cat([x.reshape(-1) for x in xs[1]])
        stats["cos"].append(float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
        stats["mean_share"].append(_energy(ms) / (sum(_energy(x) for x in xs) / len(xs)))
        noise = [torch.randn(x.shape, generator=cgen) * x.std() for x in xs[0]]
        energy["x"] += sum(_energy(x) for x in xs)
        energy["noise"] += _energy(noise)
        energy["mean"] += _energy(ms)
        for name, (fn, _) in COMPRESSORS.items():
            s = sums[name]
            draw = int(torch.randint(1 << 30, (1,), generator=cgen))
            comp = []
            for x in xs:  # every replica draws the same random subset
                shared = torch.Generator().manual_seed(draw)
                c = [fn(t, shared) for t in x]
                s["kept"] += _energy(x) - _energy([t - ct for t, ct in zip(x, c)])
                comp.append(c)
            s["noise"] += _energy(noise) - _energy([t - fn(t, cgen) for t in noise])
            cm = [torch.stack(c).mean(0) for c in zip(*comp)]
            s["mean"] += _energy(ms) - _energy([m - c for m, c in zip(ms, cm)])

    t0 = time.perf_counter()
    warmup = max(1, steps // 20)
    sim.train(steps, lambda step: [get_batch(train, batch, cfg.seq_len, g) for g in gens],
              lambda step: lr * min(1.0, (step + 1) / warmup), sync)
    shapes = [start[i].shape for i in pick]
    numel = sum(math.prod(s) for s in shapes)
    rows = []
    for name, (_, nbytes) in COMPRESSORS.items():
        s = sums[name]
        rows.append({"compressor": name,
                     "bytes_per_param_sync": sum(nbytes(*sh) * math.prod(sh) for sh in shapes)
                     / numel,
                     "kept": s["kept"] / energy["x"], "kept_on_noise": s["noise"] / energy["noise"],
                     "mean_kept": s["mean"] / energy["mean"]})
    return {"model": model, "optimizer": optimizer, "batch": batch, "replicas": replicas,
            "steps": steps, "inner_steps": h, "lr": lr, "seed": seed, "matrices": len(shapes),
            "matrix_params": numel, "syncs_measured": len(stats["cos"]),
            "cosine": stats["cos"], "mean_share": stats["mean_share"], "rows": rows,
            "seconds": time.perf_counter() - t0}


def table(res: dict) -> str:
    seq = gpt_config(res["model"]).seq_len
    lines = [f"{res['optimizer']} inner steps, batch {res['batch']} x {seq} tokens per replica, "
             f"{res['replicas']} replicas, H={res['inner_steps']}, {res['syncs_measured']} syncs: "
             f"cosine between replicas {', '.join(f'{c:.3f}' for c in res['cosine'])}; energy of "
             f"the mean / a replica's {', '.join(f'{c:.3f}' for c in res['mean_share'])}",
             f"| compressor | B/param/sync | B/param/step at H={res['inner_steps']} | kept | "
             "kept on noise | mean kept |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['compressor']} | {r['bytes_per_param_sync']:.4f} | "
                     f"{r['bytes_per_param_sync'] / res['inner_steps']:.5f} | {r['kept']:.3f} | "
                     f"{r['kept_on_noise']:.3f} | {r['mean_kept']:+.3f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = Parser(prog="bench_compressibility.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini", choices=("tiny", "mini", "small"),
                   help="GPT preset")
    p.add_argument("--batches", default="8,64", help="comma list of sequences per replica")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=120, help="inner steps per batch size")
    p.add_argument("--inner-steps", type=int, default=30, help="H, steps between syncs")
    p.add_argument("--optimizer", default="muon", choices=("muon", "adamw"),
                   help="the inner optimizer (Muon's Newton-Schulz in fp32)")
    p.add_argument("--lr", type=float, default=None,
                   help="inner lr after a 5%% warm-up (default: 5e-3 for Muon, 1e-3 for AdamW)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000,
                   help="bytes of the standard library's sources to train on")
    p.add_argument("--out", default="results/compressibility")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.replicas < 2:
        p.error("--replicas must be at least 2 (the mean needs two pseudo-gradients)")
    if args.steps < 2 * args.inner_steps:
        p.error(f"--steps must be at least 2 x --inner-steps ({2 * args.inner_steps}): the "
                "first period is skipped")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches takes a comma list of integers, got {args.batches!r}")
    out = []
    for b in batches:
        lr = args.lr or (5e-3 if args.optimizer == "muon" else 1e-3)
        res = run(args.model, b, args.replicas, args.steps, args.inner_steps, lr, args.seed,
                  args.optimizer, args.corpus_bytes)
        print(table(res), flush=True)
        out.append(res)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "compressibility.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {path / 'compressibility.json'}")
    return out


if __name__ == "__main__":
    main()
