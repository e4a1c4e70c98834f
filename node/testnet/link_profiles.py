"""Named link profiles: realistic one-way links for the emulated WAN, each with the measurement it comes from.

A profile is data: one-way latency, uniform jitter and bandwidth of the link a peer sends on
(`dsd.node.peer.shaper.LinkProfile` emulates it). Every process shapes what it sends, so a hop from peer A
to peer B is A's profile: one crossing of A's uplink, the backbone and B's downlink. `--wan-*` options given
with a profile override that field (`build_link`); docs/link_profiles.md says what each profile emulates,
what it does not, and how the numbers were derived.

- `paper`: latency only (the caller's), as the DSD paper's timing model (arXiv 2511.11733) has it.
- `home`: two residential peers in one region. Latency: FCC, Thirteenth Measuring Broadband America Fixed
  Broadband Report (2023, data of Sept.-Oct. 2022), median idle latency by ISP: cable 12-24 ms round trip
  to the nearest test server, i.e. 9 ms one way per access at the midpoint, two accesses per hop, plus
  4 ms of regional backbone (Azure East US <-> East US 2, 8 ms P50 round trip, table of 9 April 2024) = 22 ms.
  Jitter ±5 ms: our assumption, below the ±6 ms spread of those ISP medians. Bandwidth: Ookla Speedtest
  Intelligence Q4 2022 median upload of the largest US cable ISPs (Comcast 20.42, Charter 11.77,
  Cox 10.71 Mbit/s; Fierce Network, 2023), rounded down to 10 Mbit/s: the sender's uplink is the
  hop's bottleneck, downlinks being ten to twenty times faster.
- `continental`: datacenter peers across one continent. Microsoft, "Azure network round-trip latency
  statistics", table of 9 April 2024 (30-day P50), East US tab: West US 2 -> East US 67 ms round trip,
  34 ms one way. Jitter ±1 ms: our assumption (the table gives medians only). Bandwidth not limited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsd.node.peer.shaper import LinkProfile


@dataclass(frozen=True)
class NamedProfile:
    """One named link: one-way latency (None: the caller's), uniform jitter, bandwidth (None: unlimited),
    what it emulates and where its numbers come from."""

    name: str
    latency_ms: float | None
    jitter_ms: float
    mbit: float | None
    emulates: str
    source: str

    def link(self, latency_ms: float | None = None, jitter_ms: float | None = None,
             mbit: float | None = None) -> LinkProfile:
        """This profile as a LinkProfile, each field given replacing the profile's (mbit 0 = unlimited);
        ValueError for a combination the shaper refuses (jitter above latency)."""
        latency = latency_ms if latency_ms is not None else (self.latency_ms or 0.0)
        jitter = jitter_ms if jitter_ms is not None else self.jitter_ms
        return LinkProfile.from_options(latency, jitter, mbit if mbit is not None else self.mbit)


PAPER = NamedProfile(
    name="paper", latency_ms=None, jitter_ms=0.0, mbit=None,
    emulates="latency only: the one-way latency given (--wan-latency-ms), no jitter, unlimited bandwidth",
    source="DSD, Decentralized Speculative Decoding (arXiv 2511.11733), timing model T = k(t0 + (N-1) t1): "
           "t1 is one link's latency; jitter and bandwidth are not modelled",
)
HOME = NamedProfile(
    name="home", latency_ms=22.0, jitter_ms=5.0, mbit=10.0,
    emulates="two residential cable peers in one region: sender's uplink, regional backbone, receiver's downlink",
    source="latency: FCC, Thirteenth Measuring Broadband America Fixed Broadband Report (2023; data Sept.-Oct. "
           "2022), median idle latency by ISP, cable 12-24 ms round trip (9 ms one way per access at the "
           "midpoint, two per hop) + 4 ms backbone (Azure round-trip latency statistics, 9 April 2024: East US "
           "<-> East US 2, 8 ms); jitter ±5 ms assumed, under the ±6 ms spread of those medians; bandwidth: "
           "Ookla Speedtest Intelligence Q4 2022 median upload, Comcast 20.42 / Charter 11.77 / Cox 10.71 "
           "Mbit/s (Fierce Network, 2023), rounded down to 10",
)
CONTINENTAL = NamedProfile(
    name="continental", latency_ms=34.0, jitter_ms=1.0, mbit=None,
    emulates="datacenter peers across one continent (US east coast to west coast), no residential access link",
    source="Microsoft, Azure network round-trip latency statistics (learn.microsoft.com), table of 9 April "
           "2024, 30-day P50, East US tab: West US 2 -> East US 67 ms round trip = 34 ms one way; jitter "
           "±1 ms assumed (the table gives medians only); bandwidth not limited",
)
PROFILES: dict[str, NamedProfile] = {p.name: p for p in (PAPER, HOME, CONTINENTAL)}


def named(name: str) -> NamedProfile:
    """The profile called `name`; ValueError naming the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r} (known: {', '.join(PROFILES)})") from None


def build_link(name: str | None, latency_ms: float | None = None, jitter_ms: float | None = None,
               mbit: float | None = None) -> LinkProfile:
    """The one way options become a link: profile `name` (None: `paper`, latency only) with each explicit
    `--wan-*` value overriding its field; ValueError for an unknown name or a bad combination."""
    return named(name or PAPER.name).link(latency_ms, jitter_ms, mbit)


def peer_link(name: str, swarm_latency_ms: float) -> LinkProfile:
    """The link of a peer given profile `name` by `--peer-profile`: its own numbers, `paper` taking the swarm's
    latency."""
    profile = named(name)
    return profile.link(swarm_latency_ms if profile.latency_ms is None else None)


def parse_peer_profiles(items: Sequence[str], count: int) -> dict[int, str]:
    """`--peer-profile INDEX:NAME` values as {peer index: profile name} for `count` peers; ValueError naming
    the bad item (form, index out of range, a peer given twice, an unknown profile)."""
    out: dict[int, str] = {}
    for item in items:
        index, sep, name = item.partition(":")
        if not sep or not index.strip().isdigit() or not name.strip():
            raise ValueError(f"--peer-profile {item}: expected INDEX:NAME, e.g. 1:home")
        i, name = int(index), name.strip()
        if not 0 <= i < count:
            raise ValueError(f"--peer-profile {item}: peer index {i} is not in 0..{count - 1}")
        if i in out:
            raise ValueError(f"--peer-profile {item}: peer {i} already has profile {out[i]}")
        try:
            named(name)
        except ValueError as exc:
            raise ValueError(f"--peer-profile {item}: {exc}") from None
        out[i] = name
    return out


def link_record(name: str | None, link: LinkProfile) -> dict:
    """How the testnet state records a link: the profile's name (None: no profile named) and its numbers."""
    return {"profile": name, **link.as_dict()}


def describe(record: dict) -> str:
    """One line for `testnet status`: `home 22±5 ms, 10 Mbit/s` (a `link_record`)."""
    name = record.get("profile")
    latency, jitter, mbit = record.get("latency_ms") or 0.0, record.get("jitter_ms") or 0.0, record.get("mbit")
    delay = f"{latency:g}±{jitter:g} ms" if jitter else f"{latency:g} ms"
    rate = f"{mbit:g} Mbit/s" if mbit else "unlimited"
    return f"{name + ' ' if name else ''}{delay}, {rate}"
