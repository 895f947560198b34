"""Real vLLM through meshrl's adapter, outside torchrun: build, load our weights, greedy vs the native engine."""
import json, os, sys, time
import torch


def main():
    from meshrl.runtime.config import RLConfig, validate
    from meshrl.runtime.engine.build import build_engine, build_native_engine
    from meshrl.runtime.engine.api import Request
    from meshrl.runtime.engine.sampling import SamplingParams
    from meshrl.runtime.policy import build_policy
    out = {}
    dev, dtype = torch.device("cuda:0"), torch.bfloat16
    cfg = validate(RLConfig, {"model": {"flavor": "tiny", "tokenizer": "char"}, "inference": {"backend": "vllm", "max_num_seqs": 16, "max_model_len": 128}})
    model, _ = build_policy(cfg.model, dev, dtype)
    t = time.time()
    eng = build_engine(cfg.inference, cfg.model, dev, dtype, 0)
    out["vllm_start_s"] = time.time() - t
    print("vllm built", out, flush=True)
    t = time.time()
    eng.load_weights(model.named_parameters())
    out["load_s"] = time.time() - t
    native = build_native_engine(cfg.inference.model_copy(update={"backend": "native"}), cfg.model, dev, dtype, 0, model=model)
    prompts = [[(7 * i + j) % 100 + 3 for j in range(5 + i)] for i in range(8)]
    res = {}
    for name, e in (("vllm", eng), ("native", native)):
        for i, p in enumerate(prompts):
            e.add(Request(i, p, SamplingParams(temperature=0.0, max_tokens=16)))
        done = []
        while e.has_work():
            done += e.step()
        res[name] = {c.request_id: (list(c.token_ids), [round(float(x), 3) for x in c.logprobs]) for c in done}
    out["greedy_equal"] = sum(res["vllm"][i][0] == res["native"][i][0] for i in range(8))
    out["example"] = {k: res[k][0] for k in res}
    print(json.dumps(out), flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "vllm_check.json"), "w"))


if __name__ == "__main__":
    main()
