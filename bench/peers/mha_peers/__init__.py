"""Framework peers for mha_bench: PyTorch, ONNX Runtime and OpenVINO attention, timed on the
benchmark's own shapes and tensors (bench/peers.h describes the protocol)."""
