"""
ExoFormer for Hugging Face transformers: a thin wrapper over model.py's GPT, which sits beside this file in an
exported folder (hf.py's export copies both there unchanged). With the folder, or a Hub repository that holds one:

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

ExoFormerConfig carries GPTConfig's fields in config.json; ExoFormerForCausalLM's forward returns logits (and the
loss, given labels) computed by GPT itself, and generate() runs through transformers' GenerationMixin on model.py's
KVCache (use_cache=False: the plain path, the whole window every step). Past block_size tokens the window slides
and is run from position 0 again, as model.generate does. The forward is plain causal attention (no document
mask), as sample.py and eval.py run the model. transformers imports this file as a package module, so model.py
comes in by a relative import (transformers copies the files that a module imports relatively along with it).
"""
from dataclasses import asdict, fields

from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .model import GPT, IGNORE, GPTConfig, KVCache, chunked_loss, rotary_tables

HF_IGNORE = -100  # the label transformers' losses ignore (its ignore_index); ours is model.IGNORE


class ExoFormerConfig(PretrainedConfig):
    """GPTConfig's fields as attributes, under transformers' usual names too (hidden_size, ...)."""
    model_type = "exoformer"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "max_position_embeddings": "block_size"}

    def __init__(self, **kwargs):
        for name, default in asdict(GPTConfig()).items():
            setattr(self, name, kwargs.pop(name, default))
        kwargs.setdefault("tie_word_embeddings", False)  # lm_head is untied from wte (transformers' default ties)
        super().__init__(**kwargs)
        self.gpt_config()  # a bad field fails here, in GPTConfig's own words

    def gpt_config(self):
        return GPTConfig(**{f.name: getattr(self, f.name) for f in fields(GPTConfig)})


class ExoFormerForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ExoFormerConfig
    base_model_prefix = "gpt"  # model.safetensors holds GPT's own state dict: transformers adds "gpt." on loading
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.gpt = GPT(config.gpt_config())
        self.post_init()

    def _init_weights(self, module):
        """GPT initialises itself when built; transformers calls this for what a checkpoint does not hold, and
        builds models on the meta device first: the RoPE tables (buffers derived from the config, in no file)."""
        if isinstance(module, GPT):
            c = module.config
            cos, sin = rotary_tables(c.head_dim, c.block_size, c.rope_theta)
            module.rope_cos.data, module.rope_sin.data = cos.to(module.rope_cos.device), sin.to(module.rope_sin.device)

    def get_input_embeddings(self):
        return self.gpt.wte

    def get_output_embeddings(self):
        return self.gpt.lm_head

    def forward(self, input_ids, attention_mask=None, labels=None, cache=None, use_cache=None, **kwargs):
        """input_ids (B, T) -> logits (B, T, V) and, with labels (B, T), the mean cross-entropy of predicting
        labels[:, 1:] from positions :-1 (transformers' convention: labels are the inputs, shifted here)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("ExoFormer: attention_mask with padding (zeros) is not supported; pass unpadded "
                             "sequences of one length (lm-evaluation-harness pads on the right, without a mask)")
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise ValueError(f"ExoFormer: {name}=True is not supported")
        cache = cache if isinstance(cache, KVCache) else None
        h = self.gpt.features(input_ids, cache=cache)
        loss = None
        if labels is not None:
            targets = labels[:, 1:].masked_fill(labels[:, 1:] == HF_IGNORE, IGNORE)
            loss = chunked_loss(h[:, :-1].flatten(0, 1), self.gpt.lm_head.weight, targets.flatten(), 0.0,
                                self.gpt.loss_chunk)
        return CausalLMOutputWithPast(loss=loss, logits=self.gpt.lm_head(h), cache=cache)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generation keeps model.py's KVCache (prepare_inputs_for_generation), not transformers' own

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, use_cache=True, **kwargs):
        """The next forward's inputs, as model.generate steps: the whole window (the last block_size tokens) with a
        new KVCache at the start, and whenever the sequence is longer than block_size; else only the newest token
        on the cache. use_cache=False: the whole window, every step."""
        window = input_ids[:, -self.config.block_size:]
        if not use_cache:
            return {"input_ids": window, "use_cache": False}
        if not isinstance(cache, KVCache) or input_ids.size(1) > self.config.block_size or not len(cache):
            return {"input_ids": window, "cache": KVCache(self.config.n_layer), "use_cache": True}
        return {"input_ids": input_ids[:, -1:], "cache": cache, "use_cache": True}
