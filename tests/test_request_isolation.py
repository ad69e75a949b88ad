"""One request fails alone. A real `kvstrata serve` over a checkpoint whose token POISON embeds
to NaN: a sampled request containing it cannot be sampled, and ends alone with a 500 (an error
event in a stream) instead of "stop"; its batch mates' outputs equal their cold runs, and the
server's pools stay intact. In the engine itself, anything one request raises in a step (here
its token hook, where a P/D prefill sends its pages) ends that request only."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from safetensors.torch import load_file, save_file

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import Sampler, SamplingParams
from kvstrata.model.checkpoint import load_model
from tests.serve_helpers import TINY_ENGINE, Server
from tests.tiny_models import make_llama

POISON = 7  # this token's embedding row is NaN
MATES = [[(3 * i + j) % 97 for i in range(25) if (3 * i + j) % 97 != POISON] for j in range(3)]
BAD = [11, 12, POISON, 13, 14, 15]


def poisoned_checkpoint(root: Path) -> Path:
    """A tiny Llama whose embedding of POISON is NaN (everything after it in a prompt is NaN)."""
    ckpt = make_llama(root / "tiny", seed=5, max_position_embeddings=256)
    (weights,) = ckpt.glob("*.safetensors")
    tensors = load_file(str(weights))
    tensors["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return ckpt


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("isolation")
    ckpt = poisoned_checkpoint(tmp)
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "96", "--host-pages", "64"]
    srv = Server([*args, "--debug-endpoints"], tmp / "server.log")
    yield srv
    assert srv.terminate() == 0, (tmp / "server.log").read_text()


def complete(url: str, prompt: list[int], **kw: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


MATE_KW: list[dict[str, object]] = [
    {"temperature": 0},
    {"temperature": 1.0, "seed": 5},
    {"temperature": 0.8, "top_p": 0.9, "seed": 4},
]


def test_unsamplable_request_fails_alone(server: Server) -> None:
    cold = [
        complete(server.url, p, **kw).json()["choices"][0]["text"]
        for p, kw in zip(MATES, MATE_KW, strict=True)
    ]
    r = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    got: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        if i == len(MATES):
            got[i] = complete(server.url, BAD, temperature=1.0, seed=1)
        else:
            got[i] = complete(server.url, MATES[i], **MATE_KW[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(MATES) + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    bad = got[len(MATES)]
    assert bad.status_code == 500, bad.text
    assert "cannot sample" in bad.json()["error"]["message"]
    for i in range(len(MATES)):
        assert got[i].status_code == 200, got[i].text
        assert got[i].json()["choices"][0]["text"] == cold[i]
        assert got[i].json()["choices"][0]["finish_reason"] == "length"
    assert server.wait_idle()["ok"]
    # the failed request's pages went back: later requests still equal their cold runs
    again = [
        complete(server.url, p, **kw).json()["choices"][0]["text"]
        for p, kw in zip(MATES, MATE_KW, strict=True)
    ]
    assert again == cold
    assert server.wait_idle()["ok"]


def test_unsamplable_request_streams_an_error(server: Server) -> None:
    body = {"model": "tiny", "prompt": BAD, "max_tokens": 6, "temperature": 1.0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and "cannot sample" in err["message"]
    assert not any('"finish_reason": "stop"' in e for e in events)
    assert server.wait_idle()["ok"]


def test_a_request_that_raises_in_a_step_fails_alone(tmp_path: Path) -> None:
    """Its token hook raises (the point where a P/D prefill sends its pages): that request ends
    with a 500 failure, the others finish with their cold outputs, every pool holds."""
    model = load_model(make_llama(tmp_path / "tiny", seed=6, max_position_embeddings=256))
    cache = CacheConfig(page_size=8, device_pages=64, host_pages=64)
    cfg = EngineConfig(chunk_tokens=16, max_batch_tokens=64)

    def requests() -> list[Request]:
        out = [Request(f"m{i}", list(p), 8) for i, p in enumerate(MATES)]
        params = SamplingParams(temperature=1.0, seed=2)
        out.append(Request("s", list(MATES[0][:20]), 8, sampler=Sampler(params, "s")))
        return out

    cold_built = build_engine(cfg, cache, model=model)
    cold = {r.rid: r.output for r in cold_built.engine.run(requests())}
    cold_built.close()

    built = build_engine(cfg, cache, model=model)
    eng = built.engine

    def hook(req: Request, tok: int) -> None:
        if req.rid == "m1" and len(req.output) == 3:
            raise RuntimeError("hand-off hook broke")

    eng.on_token = hook
    done, failed = {}, []
    for req in requests():
        eng.submit(req)
    while eng.has_work():
        result = eng.step()
        for req in result.ended:
            done[req.rid] = req
        failed += [req.rid for req in result.failed]
        eng.check_integrity()
    assert failed == ["m1"]  # the step that failed it says so
    assert done["m1"].finish_reason == "error"
    assert done["m1"].failure is not None and done["m1"].failure[0] == 500
    assert "hand-off hook broke" in done["m1"].failure[1]
    for rid in ("m0", "m2", "s"):
        assert done[rid].failure is None and done[rid].output == cold[rid], rid
    assert not eng.running and not eng.waiting
    built.close()
