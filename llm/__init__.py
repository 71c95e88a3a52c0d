"""pagedkv.llm: offline generation, vLLM's `LLM` API, over a pagedkv daemon and runner that it
starts (or finds running); text through the model directory's tokenizer (transformers).

    from pagedkv.llm import LLM, SamplingParams

    with LLM(model="/models/qwen2.5-0.5b") as llm:
        outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.7))
        print(outputs[0].outputs[0].text)
"""

from pagedkv.client.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.llm import LLM

__all__ = ["LLM", "CompletionOutput", "LLMConfig", "RequestOutput", "SamplingParams"]
