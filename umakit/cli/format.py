"""Turning the library's numbers into short human-readable text."""

from __future__ import annotations

import sys
import time

import click


def size(n: float) -> str:
    """Bytes in binary units: 1.5 GiB, 270 MiB, 12 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


def decode_line(stats) -> str:
    """'decode 41.2 tok/s · 372 GB/s · 47% of 800 GB/s (M2 Ultra)'; a speculative run adds how far
    past the one-token roofline it went, and counts the bytes it really read."""
    line = f"decode {stats.decode_tps:.1f} tok/s"
    spec = stats.speculative
    if stats.peak_gbps:
        src = "" if stats.bandwidth_source == "published" else f", {stats.bandwidth_source}"
        read = spec.bytes_per_token * stats.decode_tps / 1e9 if spec is not None else stats.achieved_gbps
        line += (f" · {read:.1f} GB/s · {100 * read / stats.peak_gbps:.0f}% of "
                 f"{stats.peak_gbps:.0f} GB/s ({stats.device_name}{src})")
    if spec is not None and spec.target_steps:
        over = (f"{stats.over_roofline:.2f}x the one-token roofline ({stats.ceiling_tps:.0f} tok/s) · "
                if stats.ceiling_tps else "")
        line += (f" · {over}{spec.method.replace('_', ' ')}: {100 * spec.acceptance_rate:.0f}% of {spec.proposed} "
                 f"proposed accepted, {spec.tokens_per_step:.2f} tok per target step")
    if stats.offload is not None:
        from umakit.plan.placement import ROUTED_EXPERTS  # only an offloaded run needs the planner

        experts = stats.offload.placement == ROUTED_EXPERTS
        line += (f" · streamed {'experts ' if experts else ''}{size(stats.pcie_bytes_per_token)}/token at "
                 f"{stats.pcie_gbps:.1f} GB/s (link {stats.pcie_peak_gbps:.0f} GB/s) · "
                 f"{100 * stats.overlap_efficiency:.0f}% of the offload ceiling {stats.offload_ceiling_tps:.1f} tok/s")
        if experts and stats.offload.hit_rate is not None:
            line += f" · expert cache hits {100 * stats.expert_hit_rate:.0f}%"
    if stats.comm_s_per_token:
        line += f" · link {1e3 * stats.comm_s_per_token:.2f} ms/token ({100 * stats.comm_share:.0f}% of a step)"
    return line


def stats_line(stats) -> str:
    """One line for stderr after a generation."""
    parts = [f"prompt {stats.prompt_tokens} tok"]
    if stats.cached_tokens:
        parts.append(f"cached {stats.cached_tokens} tok")
    parts += [
        f"TTFT {stats.ttft_s:.2f} s",
        f"prefill {stats.prefill_tps:.1f} tok/s",
        f"{stats.generated_tokens} tok generated",
        decode_line(stats),
        f"peak mem {size(stats.peak_memory_bytes)}",
    ]
    return " · ".join(parts)


class Progress:
    """'[#####-----] 12/40 · 3456 tok · 45.6 tok/s · ETA 1m23s' on stderr.

    Redrawn in place on a terminal; elsewhere (a log file) one line at most
    every `LOG_EVERY_S` seconds, and always at the end.
    """

    LOG_EVERY_S = 10.0
    WIDTH = 20

    def __init__(self, total: int):
        self.total, self.done, self.tokens = total, 0, 0
        self.t0 = self.t_logged = time.perf_counter()
        self.tty = sys.stderr.isatty()
        if self.tty and total:
            self._draw()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        filled = self.WIDTH * self.done // self.total if self.total else self.WIDTH
        parts = [f"[{'#' * filled}{'-' * (self.WIDTH - filled)}] {self.done}/{self.total}", f"{self.tokens} tok"]
        parts.append(f"{self.tokens / elapsed:.1f} tok/s" if elapsed > 0 else "- tok/s")
        if 0 < self.done < self.total:
            eta = elapsed / self.done * (self.total - self.done)
            parts.append(f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
        return " · ".join(parts)

    def _draw(self) -> None:
        click.echo("\r" + self.line() + "\x1b[K", err=True, nl=False)

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        if self.tty:
            self._draw()
        elif time.perf_counter() - self.t_logged >= self.LOG_EVERY_S:
            self.t_logged = time.perf_counter()
            click.echo(self.line(), err=True)

    def close(self) -> None:
        if self.tty:
            click.echo(err=True)
        else:
            click.echo(self.line(), err=True)
