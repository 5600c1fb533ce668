"""Small helpers shared by the speculative-loop tests."""

from hyspec.speculative.telemetry import SpecTelemetry


class RoundLog(SpecTelemetry):
    """SpecTelemetry that also keeps every round's (drafted, accepted)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[int, int]] = []

    def record_round(self, drafted: int, accepted: int) -> None:
        super().record_round(drafted, accepted)
        self.log.append((drafted, accepted))
