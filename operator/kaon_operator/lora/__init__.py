"""LoRA adapters (spec.adapters): what they add to the engine pod (adapter_pods), what each pod
must load or unload (adapters: pure) and the loop that does it (adapter_sync)."""
