"""The head's decoding modes, kept free of heavy imports so the CLI can list them at `--help` speed."""

MODES = ("ar", "sd", "dsd", "dsd-adaptive")

MODE_HELP = (
    "ar: one token per trip (what Petals does); sd: draft, send, wait; "
    "dsd: draft the next window while this one is in flight (default); "
    "dsd-adaptive: dsd plus relaxed verification, LOSSY unless --tau-max 0"
)
