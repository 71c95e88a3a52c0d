"""pagedkv.llm: offline generation, vLLM's `LLM` API, over a pagedkv daemon and runner that it
starts (or finds running); text through the model directory's tokenizer (transformers).

    from pagedkv.llm import LLM, SamplingParams, StructuredOutputs

    with LLM(model="/models/qwen2.5-0.5b") as llm:
        outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.7))
        print(outputs[0].outputs[0].text)
        schema = '{"type": "object", "properties": {"name": {"type": "string"}}}'
        params = SamplingParams(structured_outputs=StructuredOutputs(json=schema))
        print(llm.generate(["My name is"], params)[0].outputs[0].text)   # '{"name": ...}'
"""

from pagedkv.client.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.client.pool.structured_outputs import StructuredOutputs
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.llm import LLM

__all__ = ["LLM", "CompletionOutput", "LLMConfig", "RequestOutput", "SamplingParams",
           "StructuredOutputs"]
