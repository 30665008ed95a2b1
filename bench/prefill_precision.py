"""Where do the bundled model's int4/int8 prompt rows land, through the C step and through torch?

Issue 49 §2: with one int8 pass per activation block (KAON_CPU_ACTIVATIONS=int8) the invariant C
prefill of the int4 model (the default since onepass) answered "What is the capital of France?" with "L'Étoile, la
Marseillaise," where torch's prefill answers "The capital of France is Paris."; with two passes
(KAON_CPU_ACTIVATIONS=int8x2) it is nearer the weights' exact arithmetic than torch's prefill. This measures, per
chat prompt, the first answer token's log-probabilities of three computations of the same prompt
in the same engine:
  reference  every quantized linear, the head too, multiplies float32 activations by its
             dequantized weight (quant/reference.py: what the weights specify, no activation rounding);
  torch      torch's prefill of quantized weights (KAON_CPU_PREFILL=torch; not invariant):
             torch's int4/int8 CPU kernels (bfloat16 activations), the head through the C kernel;
  fused      the invariant C step (the default) and the same head; both C kernels take the activations as
             KAON_CPU_ACTIVATIONS says: int8 (the default) one int8 pass per block of 32
             (llama.cpp's trade), int8x2 two (the block and its rounding remainder).
It prints the reference's top-two margin, whether each path keeps the reference's top token, the
largest |difference| of log-probability over the reference's top 5, and each path's final hidden
state's error against the reference. A bug in the C step's indexing (scales of another row or
group) shows as errors far above torch's; the activations' rounding as errors of the same order.

--dtype bfloat16 / float16 (with --quantization): the same three computations of the model in that dtype
(its int4/int8 weights, norms and KV cache in it): torch's path is then what such a model ran before the C
step took it (the dtype's activations between layers), the reference its dequantized weights in that dtype.

    [KAON_CPU_ACTIVATIONS=int8x2] .venv/bin/python bench/prefill_precision.py [--quantization int8]
        [--dtype bfloat16] [--prompts 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KAON_CPU_PREFILL", "fused")  # (measured() below calls both paths itself)

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.models import decoder
from kaon_runtime.quant.linear import QuantizedLinear
from support import MODEL
from support.prompts import QUESTIONS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default=None, help="int8 or int4 (default: the bundled model's own)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the model's dtype under --quantization")
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    extra = {} if args.quantization is None else {"quantization": args.quantization, "dtype": args.dtype}
    llm = LLM(MODEL, show_progress=False, device="cpu", enable_prefix_caching=False, **extra)
    lm = llm.engine.runner.model
    quantized = [m for m in lm.modules() if isinstance(m, QuantizedLinear)]
    head = lm.lm_head
    tokenizer = llm.tokenizer
    original = decoder.DecoderModel.forward
    rows: list[dict] = []

    def logprobs(hidden: torch.Tensor, reference: bool) -> torch.Tensor:
        saved = head.cpu_logits_rows
        if reference:
            head.cpu_logits_rows = 0  # the head's own QuantizedLinear, in its reference arithmetic
        try:
            return lm.compute_logits(hidden[-1:]).float().log_softmax(-1)[0]
        finally:
            head.cpu_logits_rows = saved

    def measured(self, x, positions, meta, residual=None):
        if not meta.prefills:
            return original(self, x, positions, meta, residual)
        for m in quantized:
            m.reference = True
        ref_hidden = self._layers(x, positions, meta).float()
        ref = logprobs(ref_hidden, reference=True)
        for m in quantized:
            m.reference = False
        paths = {"torch": self._layers(x, positions, meta).float(),
                 "fused": self.cpu_decode(x, positions, meta).float()}
        top = ref.topk(5).indices
        row = {"rows": x.shape[0], "margin": (ref[top[0]] - ref[top[1]]).item(), "ref_top": int(top[0])}
        found = {}
        for name, hidden in paths.items():
            lp = found[name] = logprobs(hidden, reference=False)
            row[name] = dict(top=int(lp.argmax()) == int(top[0]), dlogp=(lp[top] - ref[top]).abs().max().item(),
                             hidden=((hidden - ref_hidden).norm() / ref_hidden.norm()).item(), first=int(lp.argmax()))
        row["apart"] = (found["fused"][top] - found["torch"][top]).abs().max().item()  # the two paths, directly
        rows.append(row)
        return paths["fused"].to(x.dtype)

    decoder.DecoderModel.forward = measured
    start = time.time()
    params = SamplingParams(temperature=0, max_tokens=1)
    print(f"model {MODEL} quantization {args.quantization or 'bundled default'} dtype {extra.get('dtype', 'auto')}; "
          f"torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'prompt':44s} {'rows':>4s} {'margin':>7s} | {'torch: top dlogp hidden':>26s} | "
          f"{'fused: top dlogp hidden':>26s}")
    for question in QUESTIONS[:args.prompts]:
        llm.chat([[{"role": "user", "content": question}]], params, use_tqdm=False)
        r = rows[-1]

        def cell(p: dict) -> str:
            word = "same" if p["top"] else repr(tokenizer.decode([p["first"]]))
            return f"{word:>8s} {p['dlogp']:6.3f} {p['hidden']:9.4f}"

        print(f"{question[:44]:44s} {r['rows']:4d} {r['margin']:7.3f} | {cell(r['torch']):>26s} | "
              f"{cell(r['fused']):>26s}")
    for name in ("torch", "fused"):
        kept = sum(r[name]["top"] for r in rows)
        print(f"{name}: reference's top token kept {kept}/{len(rows)}; mean max|dlogp| on its top 5 "
              f"{statistics.mean(r[name]['dlogp'] for r in rows):.3f} nats; mean hidden error "
              f"{statistics.mean(r[name]['hidden'] for r in rows):.4f}")
    apart = [r["apart"] for r in rows]
    print(f"fused against torch: mean max|dlogp| on the reference's top 5 {statistics.mean(apart):.3f} nats "
          f"(largest {max(apart):.3f})")
    ratio = statistics.mean(r["fused"]["hidden"] for r in rows) / statistics.mean(r["torch"]["hidden"] for r in rows)
    print(f"fused / torch hidden-state error: {ratio:.2f}x ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
