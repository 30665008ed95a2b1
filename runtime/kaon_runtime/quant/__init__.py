"""Weight quantization: int8 / int4 / fp8 weight transforms, their runtime linears, module surgery."""
from kaon_runtime.quant.surgery import METHODS, quantize_model

__all__ = ["METHODS", "quantize_model"]
