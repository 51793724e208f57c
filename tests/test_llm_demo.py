"""The offline API takes the demo's served name, as `ft serve` with no model serves it."""

from freetoken import LLM, SamplingParams
from freetoken.demo.builtin import DEMO_NAME


def test_llm_loads_the_demo_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    llm = LLM(DEMO_NAME)
    assert llm.runner.model_dir.name == DEMO_NAME and str(tmp_path) in str(llm.runner.model_dir)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
