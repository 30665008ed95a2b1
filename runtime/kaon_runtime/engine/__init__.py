"""The engine: sequences, KV block manager, scheduler, model runner, step loop."""
