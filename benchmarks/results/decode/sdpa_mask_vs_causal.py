import torch, torch.nn.functional as F
from triton.testing import do_bench
torch.manual_seed(0)
dev = "cuda"
print(torch.cuda.get_device_name())
for name, hq, hkv, e in (("zamba2-2.7b attention", 32, 32, 160), ("llama-3-8b attention", 32, 8, 128)):
    for L in (4096, 32768):
        q = torch.randn(1, hq, L, e, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, hkv, L, e, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(L, L, device=dev, dtype=torch.bool).tril()[None, None].expand(1, 1, L, L)
        gqa = hq != hkv
        f_mask = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        f_causal = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        err = (f_mask().float() - f_causal().float()).abs().max().item()
        tm, tc = do_bench(f_mask, rep=200), do_bench(f_causal, rep=200)
        print(f"{name} L={L}: explicit bool mask {tm:.2f} ms, is_causal {tc:.2f} ms, ratio {tm/tc:.2f}, max diff {err:.2e}", flush=True)
        del q, k, v, mask
        torch.cuda.empty_cache()
