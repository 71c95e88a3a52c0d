"""The client engine tests' model: a tiny Llama config (random-initialized by the runner and by
transformers alike) and the eight prompts of 5 to 40 tokens the tests submit together."""

from transformers import LlamaConfig

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                     pad_token_id=None)
PROMPTS = [[(7 * i + 3 * j + 1) % 128 for j in range(n)] for i, n in
           enumerate((5, 17, 33, 9, 40, 16, 23, 31))]
