"""Blazar lease documents -> committed capacity (the parsing; the real Blazar is in test_provider_openstack)."""

from __future__ import annotations

import pytest

from sco.provider.reservations import ReservationError, committed_at, parse_leases

LEASES = {
    "leases": [
        {
            "id": "l1",
            "name": "floor",
            "project_id": "p",
            "status": "ACTIVE",
            "start_date": "2026-11-29T10:00:00.000000",
            "end_date": "2026-11-29T12:00:00.000000",
            "reservations": [
                {"resource_type": "physical:host", "min": 1, "max": 3},
                {"resource_type": "virtual:instance", "amount": 4, "vcpus": 2, "memory_mb": 2048},
            ],
        },
        {
            "id": "l2",
            "name": "over",
            "status": "TERMINATED",
            "start_date": "2026-11-29T10:00:00.000000",
            "end_date": "2026-11-29T12:00:00.000000",
            "reservations": [{"resource_type": "physical:host", "max": 5}],
        },
    ]
}


def test_reservations_in_force_sum_per_resource_type() -> None:
    rs = parse_leases(LEASES)
    assert [(r.lease_id, r.resource_type, r.amount) for r in rs] == [
        ("l1", "physical:host", 3),
        ("l1", "virtual:instance", 4),
        ("l2", "physical:host", 5),
    ]
    t = rs[0].start + 60  # Blazar's dates are UTC without a zone
    assert rs[0].start == 1795946400.0  # 2026-11-29T10:00:00Z
    assert committed_at(rs, t) == {"physical:host": 3, "virtual:instance": 4}  # a terminated lease holds nothing
    assert committed_at(rs, rs[0].end) == {}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"lease": []}, 'expected {"leases": [...]}'),
        (
            {"leases": [{"id": "x", "start_date": "soon", "end_date": "2026-11-29T12:00:00"}]},
            "lease x.start_date: 'soon' is not a date",
        ),
        ({"leases": [{"id": "y", "start_date": None}]}, "lease y.start_date: expected a date, got None"),
    ],
)
def test_malformed_leases_are_refused_naming_the_field(doc: object, message: str) -> None:
    with pytest.raises(ReservationError) as e:
        parse_leases(doc)
    assert message in " ".join(e.value.lines())
