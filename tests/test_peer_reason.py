"""Chapter 7 says why mlx-vlm did not run: on a ROCm venv that is by design, not a missing install."""

from qmtp.book import peer


def test_a_rocm_venv_says_the_peer_is_left_out_on_purpose(tmp_path, monkeypatch):
    monkeypatch.setattr(peer, "available", lambda: "mlx-vlm is not installed: pip install -e '.[peer]'")
    assert "not installed" in peer.not_installed_reason(tmp_path)
    (tmp_path / peer.ROCM_MARK).touch()
    reason = peer.not_installed_reason(tmp_path)
    assert "rocm-venv" in reason and "not installed" not in reason


def test_an_installed_peer_gives_no_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(peer, "available", lambda: None)
    (tmp_path / peer.ROCM_MARK).touch()
    assert peer.not_installed_reason(tmp_path) is None
