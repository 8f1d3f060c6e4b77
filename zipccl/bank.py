"""The fixed bank of exponent codes of format version 3 (docs/FORMAT.md, "The fixed bank of codes").

Per float layout, BANK_SIZE code-length rows over the format's NSYM symbols (12-bit limited
Huffman codes that code every symbol), derived from a Gaussian model of block exponents by
bench/bank_design.py (``--sizes 32 --block 4096``); tests/test_bank.py derives them again from the
model and the rules that docs/FORMAT.md gives.
Each block of a packet names its entry in the block index, so no packet carries tables and every
decoder builds its lookup per entry once. Changing a row changes the format: a new version.
"""

from __future__ import annotations

import numpy as np
import torch

BANK_SIZE = 32

_ROWS = {
    torch.bfloat16: (
        "6acccccccccccccccca9886554322346",
        "19ccccccccccccccccbba88755433457",
        "34ccccccccccccccccbba97654333334",
        "14ccccccccccccccccaa988655444445",
        "67ccccccccccccccccaa977654332245",
        "3ccccccccccccccccbba998654432249",
        "73ccccccccccccccccaa977544333334",
        "54ccccccccccccccbaa9765543333344",
        "35ccccccccccccccccaa976543333345",
        "cacccccccccccccccbb9887544322347",
        "3cccccccccccccccccba98875432237c",
        "ccccccccccccccccccbaa8865532225a",
        "33ccccccccccccccccaa988654433334",
        "c5cccccccccccccccbba976554332334",
        "6cccccccccccccccccca98866532225b",
        "1ccccccccccccccccccca9886643336c",
        "15ccccccccccccccccaa976554444455",
        "ccccccccccccccccccba988754332237",
        "6cccccccccccccccccba97764332237c",
        "c6cccccccccccccbaa98866543332345",
        "65ccccccccccccccccaa976654332334",
        "1accccccccccccccccccb98875443347",
        "c4cccccccccccccbaa98865443333344",
        "39ccccccccccccccccaa886644332346",
        "1ccccccccccccccccccca9865443348c",
        "c8cccccccccccccccccba98655332235",
        "53ccccccccccccccbaa9886554433333",
        "6ccccccccccccccccccba97764332237",
        "66ccccccccccccccccaa976543332345",
        "16ccccccccccccccccbba97665443445",
        "38ccccccccccccccccbba98655332335",
        "c4cccccccccccccccbba988654333234",
    ),
    torch.float16: (
        "1ccccccccccccccc2346677889accccc",
        "2ccccccccccccccc1346677889accccc",
        "689988776655443333345789cccccccc",
        "49ccccccccccccbb2334344556677889",
        "1acccccccccccccc34444556677889ab",
        "46bbbbbbbbbbbbaa3344444444455667",
        "6ccccccccccccccc1235566889accccc",
        "5cccccccccccccc22333467bbbbbbbbb",
        "399988776655444434344567899acccc",
        "19aa998877555544444678aacccccccc",
        "4bccccccccccccb34443434444666799",
        "4ccccccccccc33333335679acccccccb",
        "7ccccccccc444433333457799ccccccc",
        "6788776655554444343445566789abcc",
        "1bbbbbbbbbbbbbb33444569bbbbaaaaa",
        "77887766555544444444444556677899",
        "1accccccccccbbb4455454556566889a",
        "3ccccccccccccccc2233456889accccc",
        "18898877666655554545566778899abb",
        "3ccccccccc4444333345679aaccccccc",
        "789988775544343333468abbcccccccc",
        "378877665655454444444555566789aa",
        "3899886766554433334568aacccccccc",
        "17ccccccccccccbb4455554555566778",
        "7bcccc66554544343444455667799aab",
        "8ccccccccccc3334333445689aaccccc",
        "7ccccccccccccccc2233345779accccc",
        "3ccccccccccc34443434455568899bbc",
        "79cccccccccccccc134445555667889b",
        "1ccccccccccc444444456889abbccccc",
        "3778776655444434444556677889abcc",
        "7acccccccc444444343445465678899a",
    ),
    torch.float32: (
        "69ccccccccccccccccaa886554322346",
        "1ccccccccccccccccccba88664433469",
        "54ccccccccccccccbaa9765544333334",
        "69ccccccccccccccccbba88655332236",
        "3ccccccccccccccccbba998654432249",
        "16ccccccccccccccccbba97665443445",
        "c4cccccccccccccccbba976543333334",
        "35ccccccccccccccccaa976554333334",
        "33ccccccccccccccccbba97654433334",
        "cccccccccccccccccba988754332237c",
        "c3cccccccccccccccbba976544333334",
        "3cccccccccccccccccba98875432237c",
        "76ccccccccccccccbaa9776543332345",
        "53ccccccccccccccccaa976554333334",
        "ccccccccccccccccccbaa8865532225a",
        "36ccccccccccccccbaa9766543333345",
        "1ccccccccccccccccccca9886643336c",
        "6cccccccccccccccccca98866532225b",
        "c5cccccccccccbbaa988655443333344",
        "ccccccccccccccccccba988754332237",
        "65ccccccccccccbb9988665443333344",
        "39ccccccccccccccccaa886644332346",
        "1accccccccccccccccccb98875443347",
        "65ccccccccccccccccaa976654332334",
        "c4cccccccccccccccbba988654332334",
        "c8cccccccccccccccccba98655332235",
        "c9cccccccccccccccbba886644322346",
        "14ccccccccccccccccbba97655444445",
        "15ccccccccccccccccaa976554444455",
        "5cccccccccccccccccba97755332237c",
        "38ccccccccccccccccbba98655332335",
        "17ccccccccccccccbbba977654443456",
    ),
}


def _table(dtype: torch.dtype) -> np.ndarray:
    rows = np.array([[int(c, 16) for c in row] for row in _ROWS[dtype]], dtype=np.int64)
    rows.flags.writeable = False
    return rows


BANK = {dtype: _table(dtype) for dtype in _ROWS}  # dtype -> (BANK_SIZE, NSYM) int64 code lengths, read-only
