"""Where a decode step's time goes: python bench/decode_steps.py [--rows 1 64] [--dry-run] [--out FILE].

One Qwen2.5-0.5B-shaped model (random weights, float32, bf16 autocast as the trainer samples on a GPU), one prompt's
KV cache prefilled for each row count, then each part of `Engine.decode_loop`'s step timed on its own over many steps,
synchronized before and after: the hidden-state step (the model's own forward, and replayed from a CUDA graph:
`13a_capture`), the head (`unembed`), the sampler (`pick_tokens`: top-k, Gumbel noise, log-probs) and the copy of the
picks to the host (`tolist`, the step's one sync). The whole step is timed too: its parts, launched back to back, can
overlap on the GPU. On a CPU (or with `--dry-run`, tiny shapes) the masked step stands in for the recorded one.
Writes a JSON (`--out`, default `$OUT/decode_steps.json` when `$OUT` is set, else `bench/decode_steps.json`; the H200's
run is `bench/decode_steps_h200.json`).
"""

import argparse, json, os, sys, time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nanorl from this tree, without installing it
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from engine import prompt_ids  # noqa: E402  the engine benchmark's prompts
from gpu import QWEN05, IdsTokenizer, sync  # noqa: E402  the GPU check's model shape, tokenizer and sync
from nanochat_peer import cpu_label  # noqa: E402
from nanorl.capture import CapturedDecoder, masked_decoder  # noqa: E402
from nanorl.engine import Engine, _new_cache, new_stats, plain_decoder, row_key  # noqa: E402
from nanorl.llama import DecoderConfig, Llama  # noqa: E402
from nanorl.model import Sampler  # noqa: E402
from nanorl.scale import autocast_for  # noqa: E402

DRY = {**QWEN05, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "max_position_embeddings": 256}


def per_step_ms(fn, device, steps):
    "Milliseconds per call of fn over `steps` calls after two warm-up calls, synchronized around the loop."
    for _ in range(2):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - start) * 1000 / steps


@torch.no_grad()
def parts(model, tok, rows, prompt_len, steps, device, room=0):
    "{part: ms a step} at `rows` rows, `room` more slots in the cache: each part alone, whole steps plain and captured."
    engine, sampler = Engine(model, tok), Sampler(1.0, 50)
    prompt = prompt_ids(prompt_len, model.config.vocab_size, 0)
    cache = _new_cache(model, rows, prompt_len + 4 * steps + 8 + room)  # every timed step's token, and `room`
    h = engine.prefill([prompt], rows, cache, new_stats(1, rows))        # (rows, d)
    keys = torch.tensor([row_key(0, j) for j in range(rows)], dtype=torch.long, device=device)
    x = torch.zeros(rows, dtype=torch.long, device=device)
    raw = model.unembed(h, softcap=False)
    ids, _ = engine.pick_tokens(raw, keys, 0, sampler)
    out = {"head (unembed)": per_step_ms(lambda: model.unembed(h, softcap=False), device, steps),
           "sampler (pick_tokens)": per_step_ms(lambda: engine.pick_tokens(raw, keys, 0, sampler), device, steps),
           "picks to the host (tolist)": per_step_ms(lambda: ids.tolist(), device, steps)}
    recorded = CapturedDecoder if device.type == "cuda" else masked_decoder
    for name, make in (("plain", plain_decoder), ("captured", recorded)):
        decode = make(model, cache)
        out[f"hidden states, {name}"] = per_step_ms(lambda: decode(x), device, steps)

        def whole():
            raw = model.unembed(decode(x), softcap=False)
            picks, logps = engine.pick_tokens(raw, keys, 0, sampler)
            return picks.tolist(), logps.tolist()

        out[f"whole step, {name}"] = per_step_ms(whole, device, steps)
        cache.captured = False
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=50, help="timed calls of each part")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens in the cache")
    ap.add_argument("--room", type=int, default=0, help="cache slots beyond the timed steps (a long max_new_tokens)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, a check that it runs")
    here = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench"
    ap.add_argument("--out", type=Path, default=here / "decode_steps.json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_label()
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(DecoderConfig(**(DRY if args.dry_run else QWEN05))).eval()
    tok, report = IdsTokenizer(model.config.vocab_size), {}
    torch_tag = f" | torch {torch.__version__}" if device.type == "cuda" else ""  # a CPU label names it already
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC | {label}{torch_tag} | ms a step", flush=True)
    with autocast_for(device, torch.bfloat16):
        for rows in args.rows:
            report[rows] = parts(model, tok, rows, args.prompt, args.steps, device, args.room)
            print(f"{rows:>4} rows: " + ", ".join(f"{k} {v:.2f}" for k, v in report[rows].items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": label, "torch": torch.__version__, "dry_run": args.dry_run,
                                    "prompt": args.prompt, "steps": args.steps, "room": args.room, "ms": report},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
