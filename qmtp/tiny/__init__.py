"""The bundled tiny model's tooling: the generated corpus it learns from (`corpus`), its training (`train`),
its export in the released layout (`export`), its measured card (`card`), and synthetic checkpoints of any
width, up to the full size's layout (`synthetic`). Nothing in the runtime imports these."""
