"""The CPU kernel backend: C++ ops compiled at start (build.py) for attention (attention.py,
attention_avx512.py, prefill.py), the fused norms, rotary and sampling (fused.py), the small products
(gemm.py, amx.py), the packed and quantized linear layers (linear.py), one decode layer in one call
(layer.py), and the threads they run on (threads.py)."""
