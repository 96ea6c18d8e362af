"""docs/tp_ratio_by_session.png: Qwen3-8B's two-GPU / one-GPU time per token, session by session, from
the tables of docs/performance.md (the default runtime's ratio, and the best variant each session
measured). Add a session's numbers here when docs/performance.md gets them.

    .venv/bin/python scripts/plot_tp_ratio.py
"""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
default = {4: 0.696, 5: 0.679, 6: 0.681, 9: 0.666}
best = {4: (0.682, "prefetch 2 ahead"), 5: (0.679, "combine unrolled"), 6: (0.668, "o-proj staged"),
        8: (0.672, "o-proj staged"), 9: (0.662, "+ 4 attention lanes")}
fig, ax = plt.subplots(figsize=(7, 3.6))
ax.plot(list(default), list(default.values()), "o-", label="default runtime")
ax.plot(list(best), [v for v, _ in best.values()], "s--", label="best variant of the session")
for s, (v, name) in best.items():
    ax.annotate(name, (s, v), textcoords="offset points", xytext=(4 if s < 9 else -95, -12), fontsize=7)
ax.axhline(0.6, color="red", linestyle=":", label="issue 8 target (0.6)")
ax.set_xlabel("session (2026-11-29/30)")
ax.set_ylabel("2 GPUs / 1 GPU time per token")
ax.set_title("Qwen3-8B decode over 2 H200s (tensor parallel), batch 1, context 1024")
ax.set_ylim(0.58, 0.71)
ax.set_xticks(range(4, 10))
ax.legend(fontsize=8, loc="upper right")
fig.tight_layout()
fig.savefig("docs/tp_ratio_by_session.png", dpi=110)
