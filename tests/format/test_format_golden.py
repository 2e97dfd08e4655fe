"""The tensor-file header byte for byte: a change to these bytes is a format change (docs/FORMAT.md)."""

from __future__ import annotations

from lazyckpt.format.header import TensorEntry, build_header, dcp_sharding_metadata

GOLDEN_BODY = (
    b'{"__metadata__":{"DCP_SHARDING_INFO":"{\\"model/w\\": {\\"saved_offsets\\": [0, 0]}, \\"step\\": '
    b'{\\"saved_offsets\\": []}}","DCP_VERSION":"1.0","format":"pt"},'
    b'"model/w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},'
    b'"step":{"dtype":"I64","shape":[],"data_offsets":[24,32]}}'
)


def test_the_header_is_a_length_prefix_then_json_padded_with_spaces_to_4_kib():
    entries = [TensorEntry("model/w", "F32", (2, 3), 24, 0, True), TensorEntry("step", "I64", (), 8, 24, False)]
    header = build_header(entries, dcp_sharding_metadata(entries))
    assert header == (4088).to_bytes(8, "little") + GOLDEN_BODY + b" " * (4088 - len(GOLDEN_BODY))
