"""Models: where M0 comes from, the engines that generate with it, and the GPU memory plan.

engine         the Engine interface (Sampling, Completion) every backend follows
hf_engine, vllm_engine, openai_engine    the three backends; retries: HTTP retries and secret redaction
loading        model sources (hub id, folder, tiny), loading, and `make_engine` from the params
tiny           the offline tiny model (random Qwen3 + BPE tokenizer trained on the corpus)
random_models  random models of real shapes (GPU tests)
gpu_plan       `scope plan`: GPU memory per configuration
noise          library notices dropped where they are logged (torchao, torch, bitsandbytes, vLLM on CPU)
"""
