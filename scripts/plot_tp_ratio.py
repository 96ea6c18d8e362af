"""docs/tp_ratio_by_session.png: Qwen3-8B decode over two GPUs, session by session, from the tables of
docs/performance.md: the two-GPU / one-GPU time per token (the default runtime's, and the best variant
each session measured against the best one-GPU runtime), and the default runtime's milliseconds per token
on one GPU and on two (a faster one GPU makes the ratio harder: both are shown). Add a session's numbers
here when docs/performance.md gets them.

    .venv/bin/python scripts/plot_tp_ratio.py
"""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

# session: (one GPU, two GPUs) ms per token, default runtime
default_ms = {4: (4.852, 3.378), 5: (4.842, 3.290), 6: (4.828, 3.288), 9: (4.834, 3.221), 10: (4.685, 3.114),
              11: (4.691, 3.128), 12: (4.659, 3.030), 13: (4.568, 2.934),
              14: (4.507, 2.836), 15: (4.498, 2.835), 16: (4.429, 2.773), 17: (4.432, 2.774),
              18: (4.407, 2.704)}   # (18: the attention preload, the default of both since; relay on two GPUs)
best = {4: (0.682, "prefetch 2 ahead"), 5: (0.679, "combine unrolled"), 6: (0.668, "o-proj staged"),
        8: (0.672, "o-proj staged"), 9: (0.662, "+ 4 attention lanes"), 10: (0.659, "+ 4 attention lanes"),
        11: (0.664, "default (QKV staging slower)"),
        12: (0.661, "vs 1 GPU without L2 prefetch"), 13: (0.642, "defaults (weights first on 2 GPUs)"),
        14: (0.629, "early tasks (weights before the wait)"), 15: (0.620, "32 attention splits on 2 GPUs"),
        16: (0.626, "32 splits the default, shuffle combine"), 17: (0.618, "relay (tiles sum their rows)"),
        18: (0.614, "attention rows preloaded")}
BEST_ONE_GPU_MS = 4.393   # the fastest one-GPU runtime measured (eighteenth session, call 7)
FLOOR_MS = 3.562   # one GPU: 15.14 GB over 4.25 TB/s

fig, (ax, ms) = plt.subplots(1, 2, figsize=(11, 3.8))
sessions = list(default_ms)
ax.plot(sessions, [two / one for one, two in default_ms.values()], "o-", label="default runtime")
ax.plot(list(best), [v for v, _ in best.values()], "s--", label="best variant of the session")
# (points) clear of the neighbours' labels
OFFSETS = {9: (-60, -16), 10: (-80, -24), 11: (-95, -46), 12: (-140, -62), 13: (-190, -50), 14: (-150, -38),
           15: (-150, 8), 16: (-170, 14), 17: (-150, -14), 18: (-130, -22)}
for s, (v, name) in best.items():
    ax.annotate(name, (s, v), textcoords="offset points", xytext=OFFSETS.get(s, (4, -12)), fontsize=7)
ax.axhline(0.6, color="red", linestyle=":", label="issue 8 target (0.6)")
ax.set_xlabel("session (2026-11-29 to 12-01)")
ax.set_ylabel("2 GPUs / 1 GPU time per token")
ax.set_title("ratio (the same run's one GPU)", fontsize=10)
ax.set_ylim(0.58, 0.71)
ax.set_xticks(range(4, max(default_ms) + 1))
ax.legend(fontsize=8, loc="upper right")

ms.plot(sessions, [one for one, _ in default_ms.values()], "o-", label="1 GPU")
ms.plot(sessions, [two for _, two in default_ms.values()], "o-", label="2 GPUs")
ms.axhline(FLOOR_MS, color="gray", linestyle=":", label="1 GPU floor (3.56 ms)")
ms.axhline(FLOOR_MS / 2, color="gray", linestyle="--", label="2 GPU floor (1.78 ms)")
ms.axhline(0.6 * BEST_ONE_GPU_MS, color="red", linestyle=":", label="0.6 of the fastest 1 GPU")
ms.set_xlabel("session (2026-11-29 to 12-01)")
ms.set_ylabel("ms per token (default runtime)")
ms.set_title("time per token", fontsize=10)
ms.set_ylim(1.5, 5.2)
ms.set_xticks(range(4, max(default_ms) + 1))
ms.legend(fontsize=7, loc="lower left", ncol=2)
fig.suptitle("Qwen3-8B decode over 2 H200s (tensor parallel), bf16, batch 1, context 1024", fontsize=11)
fig.tight_layout()
fig.savefig("docs/tp_ratio_by_session.png", dpi=110)
