"""pytest fixtures shared by the test modules (the doubles themselves live in doubles.py), and the `numerics` and
`slow` markers."""

import pytest

from doubles import nanochat_tokenizer

tok = pytest.fixture(scope="session", name="tok")(nanochat_tokenizer)

# The tests that compare computations whose float rounding may differ with the CPU's kernels: two runs or two code
# paths (DDP and FSDP, one rank and two, packed and plain, cached and not), nanorl against transformers or TRL, a run
# against reference numbers computed elsewhere. They carry the marker `numerics`, and on a CPU with AVX-512
# `make test` runs them a second time on its AVX2 kernels, so both instruction sets' rounding is tried. A file name
# marks the whole file; a (file, tests) pair only those tests (by function name, every parametrization).
NUMERICS = {
    "test_model.py": None,
    "test_llama.py": None,
    "test_checkpoint.py": None,
    "test_engine.py": None,
    "test_capture.py": None,
    "test_kernel.py": None,
    "test_loss.py": None,
    "test_cpu_dtypes.py": None,
    "test_trl_loss.py": None,
    "test_smollm2.py": None,
    "test_fsdp.py": {
        "test_fsdp_equals_ddp",
        "test_fsdp_is_ddp_to_the_bit",
        "test_resume_on_fewer_ranks_continues",
        "test_hf_model_under_fsdp",
    },
    "test_train.py": {
        "test_one_rank_equals_two_ranks",
        "test_option_trains",
        "test_skip_zero_signal_gives_the_same_update",
    },
    "test_on_policy.py": {
        "test_engine_logprobs_are_the_samplers",
        "test_loss_gradient_is_the_samplers",
        "test_stop_token_logprob_moves_with_its_advantage",
    },
    "test_hf_train.py": {
        "test_load_model_of_hf_folder_equals_transformers",
        "test_forced_sharding_round_trips_through_transformers",
        "test_cli_trains_and_writes_an_hf_checkpoint",
    },
}


# The files whose tests start processes (torchrun ranks, whole runs, vLLM, the README's commands) or train for long:
# marked `slow`, left out by `make test-fast`, the loop while editing. `make test` (CI) runs everything.
SLOW = {"test_reliability.py", "test_fsdp.py", "test_vllm.py", "test_vllm_train.py", "test_readme.py",
        "test_gpu_bench.py", "test_demo.py", "test_real.py", "test_hf_train.py", "test_robustness.py",
        "test_smollm2.py", "test_trl_loss.py"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "numerics: compares computations that may round differently on other CPUs (tests/conftest.py)"
    )
    config.addinivalue_line("markers", "slow: starts processes or trains for long; `make test-fast` skips it")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW:
            item.add_marker(pytest.mark.slow)
        if item.path.name in NUMERICS:
            names = NUMERICS[item.path.name]
            if names is None or getattr(item, "originalname", item.name) in names:
                item.add_marker(pytest.mark.numerics)
