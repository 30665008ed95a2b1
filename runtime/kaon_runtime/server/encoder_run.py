"""`kaon serve` of a sentence encoder: the checkpoint test, and uvicorn around server/encoder_app.py."""
from __future__ import annotations

from pathlib import Path

import uvicorn

from kaon_runtime.engine.encoder import EncoderEngine
from kaon_runtime.errors import ModelNotFoundError, UnsupportedByModelError
from kaon_runtime.loader.resolve import resolve_model
from kaon_runtime.models.bert import is_encoder_checkpoint
from kaon_runtime.server.encoder_app import EncoderSettings, create_encoder_app


def encoder_checkpoint(model: str) -> Path | None:
    """The HF directory of `model` when it is an encoder (models/bert.py); None for anything else
    (a decoder, a .gguf, random://, or a name the decoder path reports on)."""
    try:
        path = resolve_model(model)
    except ModelNotFoundError:
        return None
    return path if path.is_dir() and is_encoder_checkpoint(path) else None


def flags_that_do_not_apply(args) -> list[str]:
    """The `kaon serve` flags given that a sentence encoder's server has nothing to do with: no prefill/decode
    split (it generates nothing, so has no K/V to move) and no LoRA adapters. Refused at start rather than
    ignored, so an encoder deployed with them fails loudly instead of serving without what was asked."""
    given = [("--role " + args.role, args.role != "both"), ("--prefill-url", bool(args.prefill_url)),
             ("--enable-runtime-lora", args.enable_runtime_lora), ("--lora-modules", bool(args.lora_modules))]
    return [flag for flag, on in given if on]


def serve_encoder(root: Path, args) -> int:
    refused = flags_that_do_not_apply(args)
    if refused:
        raise UnsupportedByModelError(
            f"{', '.join(refused)} do(es) not apply to a sentence encoder ({args.model}): it generates no tokens, so "
            "it has no prefill/decode roles and takes no LoRA adapters; drop the flag (or "
            "$KAON_ALLOW_RUNTIME_LORA_UPDATING)")
    engine = EncoderEngine(root)
    settings = EncoderSettings(model_name=args.served_model_name or args.model, api_key=args.api_key,
                               api_key_file=args.api_key_file, max_body_bytes=args.max_body_bytes,
                               sleep_mode=args.enable_sleep_mode, admin_key=args.admin_key)
    server = uvicorn.Server(uvicorn.Config(create_encoder_app(engine, settings), host=args.host, port=args.port,
                                           log_level=args.log_level))
    server.run()
    return 0 if server.started else 1
