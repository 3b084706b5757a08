"""The project's one module of test doubles and fixture loaders, shared by the notebooks and the tests.

Notebooks import it with `sys.path.insert(0, "../tests")`; pytest finds it in tests/. Training tests name its task
factories on the command line: `--task doubles:toy_tasks`.
"""

import json
import random
import shutil
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NANOCHAT_HEAD = FIXTURES / "nanochat" / "head"  # tiny nanochat checkpoint (d3, random weights) and tokenizer


# ---------------------------------------------------------------- nanochat's fixtures


def nanochat_tokenizer():
    "The tokenizer nanochat's own code trained for the fixtures."
    from nanorl.tokenizer import Tokenizer

    return Tokenizer.from_directory(FIXTURES / "nanochat" / "tokenizer")


# ---------------------------------------------------------------- training runs on the tiny fixture checkpoint


def base_dir(tmp_path, name):
    "A nanochat base directory holding the tiny fixture checkpoint and tokenizer."
    d = tmp_path / name
    shutil.copytree(NANOCHAT_HEAD, d)
    return d


def checkpoints_of(base):
    "Where a run on the fixture base directory writes its checkpoints."
    return base / "chatrl_checkpoints" / "d3"


def step_files(step, ranks):
    "The files of one complete nanochat-layout checkpoint written by `ranks` ranks."
    tag = f"{step:06d}"
    return {f"model_{tag}.pt", f"meta_{tag}.json", f"optim_{tag}_rank0.pt"} | {
        name for r in range(ranks) for name in (f"resume_{tag}_rank{r}.pt", f"manifest_{tag}_rank{r}.json")
    }


def records(base, drop_timing=False):
    "The run's metrics.jsonl records (with drop_timing, without the t_* fields that differ between runs)."
    recs = [json.loads(line) for line in (checkpoints_of(base) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("t_")} for r in recs] if drop_timing else recs


def weights(base, step):
    "The model state a run saved at `step`."
    return torch.load(checkpoints_of(base) / f"model_{step:06d}.pt", weights_only=True)


# ---------------------------------------------------------------- tasks a random-weight model can vary the reward of

ROWS = [json.loads(l) for l in (Path(__file__).parent / "fixtures" / "gsm8k" / "train.jsonl").read_text().splitlines()]


class LengthTask:
    "GSM8K questions; a completion earns 1 when its length in characters is a multiple of 3."

    def __len__(self):
        return len(ROWS)

    def __getitem__(self, i):
        return {
            "messages": [
                {"role": "user", "content": ROWS[i]["question"]},
                {"role": "assistant", "content": ROWS[i]["answer"]},
            ]
        }

    def evaluate(self, conversation, completion):
        return len(completion) % 3 == 0

    def reward(self, conversation, completion):
        return float(self.evaluate(conversation, completion))


class NanLengthTask(LengthTask):
    "The toy task, but the reward of the problems in `nan_problems` (all when None) is nan: a broken reward function."

    def __init__(self, nan_problems=None):
        self.nan_questions = None if nan_problems is None else {ROWS[i]["question"] for i in nan_problems}

    def reward(self, conversation, completion):
        q = conversation["messages"][0]["content"]
        return (
            float("nan")
            if self.nan_questions is None or q in self.nan_questions
            else super().reward(conversation, completion)
        )


def toy_tasks(cfg):
    "(train, held-out): the same toy task."
    return LengthTask(), LengthTask()


def make_nan_step1_tasks(cfg):
    "Problems 2 and 3 (step 1 at 2 examples per step) have a nan reward."
    return NanLengthTask({2, 3}), LengthTask()


def make_all_nan_tasks(cfg):
    "Every reward is nan."
    return NanLengthTask(), LengthTask()


class ZeroLengthTask(LengthTask):
    "The toy task with every reward 0: every group has no signal."

    def reward(self, conversation, completion):
        return 0.0


def make_zero_tasks(cfg):
    "Every reward is 0."
    return ZeroLengthTask(), LengthTask()


class SplitToyTask:
    "The protocol's minimum, built per split as `--task doubles:SplitToyTask` does: no evaluate, 1 for an 'ok'."

    def __init__(self, split="train"):
        self.rows = ROWS[:8] if split == "train" else ROWS[8:12]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        question = self.rows[i]["question"]
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "ok"}]}

    def reward(self, conversation, completion):
        return float(completion.strip() == "ok")


class NoRewardTask(SplitToyTask):
    "Misses the protocol's reward."

    reward = None


# ---------------------------------------------------------------- pass@k without a model: tokenizer, task and engine


class ToyTokenizer:
    "Prompts are [difficulty, answer]; ids decode to their digits."

    def render_for_completion(self, conversation):
        return [conversation["difficulty"], conversation["answer"]]

    def decode(self, ids):
        return "".join(str(i) for i in ids)


class CharTokenizer:
    "Ids are characters' code points; every conversation's prompt is [0]."

    def render_for_completion(self, conversation):
        return [0]

    def encode(self, text):
        return list(map(ord, text))

    def decode(self, ids):
        return "".join(map(chr, ids))


class ToyTask:
    "Problem i: difficulty i % 10, answer i % 7; a completion is right when it is the answer."

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {"difficulty": i % 10, "answer": i % 7}

    def evaluate(self, conversation, text):
        return text == str(conversation["answer"])


class ToyEngine:
    "Right with probability difficulty/10, drawn from (prompt seed, sample index) only, as the real engine promises."

    STOP = 9  # every reply is one answer token, then this stop token

    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        from nanorl.engine import Completions

        seeds = seed if isinstance(seed, list) else [seed] * len(prompts)
        seqs = []
        for prompt, s in zip(prompts, seeds):
            difficulty, answer = prompt
            for j in range(num_samples):
                right = random.Random(s * 1_000_003 + j).random() < difficulty / 10
                seqs.append(prompt + [answer if right else (answer + 1) % 7, self.STOP])
        return Completions(seqs, [[0, 0, 1, 1] for _ in seqs], cut=[False] * len(seqs))


# ---------------------------------------------------------------- a tiny trained model: the demo's SFT checkpoint


def demo_sft(device="cpu"):
    "(model, tokenizer) of the demo's SFT model on Arithmetic, from tests/fixtures/demo_sft (see fixtures/README.md)."
    from nanorl.checkpoint import load_model

    model, tokenizer, _ = load_model("sft", device, model_tag="d3", base_dir=FIXTURES / "demo_sft")
    return model, tokenizer


# ---------------------------------------------------------------- models for the engine: fixtures, scripted, biased

FIXTURE_TAGS = {"head": ("d3", "current"), "oct2025": ("d2", "oct2025")}  # fixture folder -> (tag, generation)


def load_fixture_model(gen):
    "nanochat's tiny fixture model of one generation ('head' or 'oct2025'), loaded as a checkpoint, in eval mode."
    from nanorl.checkpoint import load_model

    tag, generation = FIXTURE_TAGS[gen]
    model, _, _ = load_model(
        "sft", "cpu", model_tag=tag, step=0, base_dir=FIXTURES / "nanochat" / gen, generation=generation
    )
    return model.eval()


class ScriptedCache:
    "Stands in for a KVCache: per row, which script it follows, its pointer into it, and its last proposal."

    def __init__(self, batch_size, seq_len=None):
        self.row, self.pointer, self.proposal = [None] * batch_size, [0] * batch_size, [None] * batch_size
        self.seqlens, self.max_seq_len = [0] * batch_size, seq_len

    @property
    def batch_size(self):
        return len(self.row)

    def get_pos(self):
        return max(self.seqlens, default=0)

    def prefill_rows(self, other, rows):
        for r in rows:
            self.pointer[r], self.proposal[r], self.seqlens[r] = other.pointer[0], other.proposal[0], other.seqlens[0]

    def select_rows(self, index):
        index = [int(i) for i in index]
        for name in ("row", "pointer", "proposal", "seqlens"):
            setattr(self, name, [getattr(self, name)[i] for i in index])
        return self


class ScriptedModel:
    """A fake model: row r proposes script[r][i] with logit 10 (0 elsewhere), and i advances when the fed token is
    the proposal (sampled, not forced). The batch-1 prefill proposes script[0][0]; exhausted scripts propose the end."""

    def __init__(self, scripts, vocab_size, end_token, sequence_len=256):
        from types import SimpleNamespace

        self.scripts, self.end_token, self.softcap = scripts, end_token, None
        self.config = SimpleNamespace(sequence_len=sequence_len, vocab_size=vocab_size)

    def get_device(self):
        return torch.device("cpu")

    def new_kv_cache(self, batch_size, seq_len=None, dtype=None):
        return ScriptedCache(batch_size, seq_len)

    def _propose(self, row, i):
        script = self.scripts[row]
        return script[i] if i < len(script) else self.end_token

    def hidden(self, idx, kv_cache=None):
        "Each row's proposal as a (B, T, 1) 'hidden state'."
        B, T = idx.shape
        props = []
        for b in range(B):
            if kv_cache.seqlens[b] == 0:  # prefill
                p = self._propose(0, 0)
            else:
                if kv_cache.row[b] is None:  # first decode step: rows are in order
                    kv_cache.row[b] = b
                if idx[b, -1].item() == kv_cache.proposal[b]:
                    kv_cache.pointer[b] += 1
                p = self._propose(kv_cache.row[b], kv_cache.pointer[b])
            kv_cache.proposal[b] = p
            kv_cache.seqlens[b] += T
            props.append(p)
        return torch.tensor(props, dtype=torch.float32).view(B, 1, 1).expand(B, T, 1)

    def unembed(self, h, softcap=True):
        "Logit 10 on each row's proposal, 0 elsewhere: (B, T, V)."
        logits = torch.zeros(*h.shape[:-1], self.config.vocab_size)
        return logits.scatter_(-1, h.long(), 10.0)


class BiasedModel(torch.nn.Module):
    "Wraps a GPT and adds a fixed bias to its raw logits (makes tool calls frequent in a tiny random model)."

    def __init__(self, base, bias):
        super().__init__()
        self.base, self.bias, self.config, self.softcap, self.lm_head = (
            base,
            bias,
            base.config,
            base.softcap,
            base.lm_head,
        )
        self.rotary_len = getattr(base, "rotary_len", None)

    def get_device(self):
        return self.base.get_device()

    def new_kv_cache(self, *args, **kwargs):
        return self.base.new_kv_cache(*args, **kwargs)

    def hidden(self, idx, kv_cache=None):
        return self.base.hidden(idx, kv_cache)

    def unembed(self, h, softcap=True):
        raw = self.base.unembed(h, softcap=False) + self.bias
        return self.softcap * torch.tanh(raw / self.softcap) if softcap and self.softcap else raw

    def forward(self, idx):
        return self.unembed(self.hidden(idx))


def tool_bias(tok):
    "A logit bias toward calculator calls, digits, + and * and the end token, for BiasedModel."
    bias = torch.zeros(tok.get_vocab_size())
    for t in ["<|python_start|>", "<|python_end|>"]:
        bias[tok.encode_special(t)] = 9.0
    bias[tok.encode_special("<|assistant_end|>")] = 5.0
    for s in "123456789":
        bias[tok.encode(s)[0]] = 10.0
    for s in "+*":
        bias[tok.encode(s)[0]] = 8.0
    return bias


# ---------------------------------------------------------------- Hugging Face chat models: tiny transformers folders

CHAT_TEMPLATES = FIXTURES / "chat_templates"  # real templates (see fixtures/chat_templates/README.md)
# The pre-tokenizers' split patterns of the real tokenizer.json files: digits one by one (Qwen2/2.5/3), up to three
# (Llama 3); the pieces are then byte-level encoded without a second regex.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

HF_FAMILIES = {  # special tokens as the real tokenizers name them; bos/eos/pad as their tokenizer_config.json sets them
    "qwen": dict(
        split=QWEN2_SPLIT,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        template="qwen2.5.jinja",
        stops=["<|im_end|>", "<|endoftext|>"],
    ),
    "llama3": dict(
        split=LLAMA3_SPLIT,
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        template="llama3.jinja",
        stops=["<|end_of_text|>", "<|eot_id|>"],
    ),
}
HF_KINDS = {"qwen2": "qwen", "qwen3": "qwen", "llama": "llama3"}  # model_type -> tokenizer family


def gsm8k_corpus():
    "Every question and answer of the GSM8K fixture files."
    rows = [
        json.loads(l)
        for split in ("train", "test")
        for l in (FIXTURES / "gsm8k" / f"{split}.jsonl").read_text().splitlines()
    ]
    return [r["question"] for r in rows] + [r["answer"] for r in rows]


def tiny_hf_tokenizer(family, vocab_size=600):
    "A transformers tokenizer: byte-level BPE trained on GSM8K fixtures, the family's split, specials and template."
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    fam = HF_FAMILIES[family]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([  # as the real files: the family's regex split, then bytes
        pre_tokenizers.Split(Regex(fam["split"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=fam["specials"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(gsm8k_corpus(), trainer)
    if fam["bos"]:  # like Llama 3's tokenizer.json: bos prepended when special tokens are added
        bos = (fam["bos"], tk.token_to_id(fam["bos"]))
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=fam["bos"], eos_token=fam["eos"], pad_token=fam["pad"])
    tok.chat_template = (CHAT_TEMPLATES / fam["template"]).read_text()
    return tok


def tiny_hf_config(model_type, vocab_size, max_position_embeddings=512):
    "A 2-layer, 64-wide transformers config: Qwen2 (biases, tied), Qwen3 (q/k norm, head_dim 32, one kv head), Llama 3."
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.15,
    )
    if model_type == "qwen2":
        return transformers.Qwen2Config(
            **common,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        )
    if model_type == "qwen3":
        return transformers.Qwen3Config(
            **common,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        )
    if model_type == "llama":
        rope = dict(
            rope_type="llama3",
            rope_theta=50000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return transformers.LlamaConfig(
            **common, num_key_value_heads=2, tie_word_embeddings=False, rope_parameters=rope
        )
    raise ValueError(f"unknown model_type {model_type!r}")


def save_tiny_hf_model(model_type, folder, dtype=torch.float32, max_shard_size=None, seed=0):
    "A random transformers model (norm scales and biases perturbed) and its tokenizer saved into folder; (model, tok)."
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tok = tiny_hf_tokenizer(HF_KINDS[model_type])
    extra = 8 if model_type == "qwen2" else 0  # Qwen's embedding is wider than its tokenizer
    config = tiny_hf_config(model_type, len(tok) + extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.3 * torch.randn_like(p))
    fam = HF_FAMILIES[HF_KINDS[model_type]]
    stops = [tok.convert_tokens_to_ids(t) for t in fam["stops"]]
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=stops, pad_token_id=tok.pad_token_id or stops[-1]
    )
    shard = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.to(dtype).save_pretrained(folder, **shard)
    tok.save_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), tok


def to_transformers4_layout(folder):
    "Rewrite folder/config.json from transformers 5's `rope_parameters` to 4.x's `rope_theta` + `rope_scaling`."
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    path.write_text(json.dumps(cfg, indent=2))
    return folder


def gsm8k_chat_conversations(n=56, system_every=4):
    "n GSM8K fixture conversations as nanorl's task builds them, every system_every-th one led by a system message."
    from nanorl.tasks import GSM8K

    tasks = [GSM8K(split=split, data_dir=FIXTURES / "gsm8k") for split in ("train", "test")]
    task = [t[i] for t in tasks for i in range(len(t))]
    out = []
    for i, conv in enumerate(task[:n]):
        if i % system_every == 1:
            system = {"role": "system", "content": f"You are a careful math tutor number {i}."}
            conv = {"messages": [system] + conv["messages"]}
        out.append(conv)
    return out


# ---------------------------------------------------------------- a real chat model, when built locally


def smollm2_folder():
    "SmolLM2-135M-Instruct's folder (`bench/smollm2.py` builds it): $NANORL_SMOLLM2, else the builder's default."
    from nanorl.real import smollm2_default

    return smollm2_default()


# ---------------------------------------------------------------- Hugging Face runs: a model that wants one token


def token_biased(model, token, bias=50.0):
    "`model` (a Llama: no softcap) with `bias` added to the logit of `token` at every position."
    vector = torch.zeros(model.config.vocab_size)
    vector[token] = bias
    return BiasedModel(model, vector)


# ---------------------------------------------------------------- Countdown through both tokenizers


def tiny_chat_tokenizer(family, folder):
    "nanorl's ChatTokenizer over tiny_hf_tokenizer(family) (its real chat template), saved into folder."
    from nanorl.chat import ChatTokenizer

    tiny_hf_tokenizer(family).save_pretrained(folder)
    return ChatTokenizer.from_directory(folder)


class ReplyEngine:
    "Stand-in engine: every sample continues its prompt with the tokens of one reply and <|assistant_end|> (mask 1)."

    def __init__(self, tokenizer, reply):
        self.reply = tokenizer.encode(reply) + [tokenizer.encode_special("<|assistant_end|>")]

    def generate_many(self, prompts, num_samples=1, seed=None, **kw):
        from nanorl.engine import Completions

        seqs = [list(p) + self.reply for p in prompts for _ in range(num_samples)]
        masks = [[0] * len(p) + [1] * len(self.reply) for p in prompts for _ in range(num_samples)]
        return Completions(seqs, masks, cut=[False] * len(seqs))


SMALL_RUN = dict(
    task="doubles:toy_tasks",
    device_type="cpu",
    examples_per_step=2,
    num_samples=4,
    device_batch_size=4,
    max_new_tokens=12,
    eval_every=100,
    eval_examples=2,
    save_every=100,
    seed=7,
    dtype="float32",  # the bounds of rounding.py are float32's; auto is bf16 on native-bf16 CPUs for the fixture's head
)


def small_run(**changes):
    "Command-line flags of a small CPU run on the toy task: SMALL_RUN with `changes` (None leaves a flag out)."
    settings = {**SMALL_RUN, **changes}
    return [w for k, v in settings.items() if v is not None for w in (f"--{k.replace('_', '-')}", str(v))]


# ---------------------------------------------------------------- vLLM's CPU backend: a tiny folder it accepts


def save_tiny_qwen2_head32(folder, seed=0):
    "save_tiny_hf_model's Qwen2 as 2 heads of 32 and 1 kv head (same weight shapes): vLLM's CPU backend rejects 16."
    save_tiny_hf_model("qwen2", folder, seed=seed)
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config.update(num_attention_heads=2, num_key_value_heads=1)
    path.write_text(json.dumps(config, indent=2))
    return Path(folder)
