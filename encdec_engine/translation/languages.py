"""Languages as users name them, and the codes each translation family spells them with.

A user names a language by its ISO 639-1 code (`de`), its ISO 639-3 code (`deu`), its English name
(`German`), or a family's own code (`de_DE` for mBART-50, `deu_Latn` for NLLB, `__de__`-style M2M100
codes are their ISO codes). `find_language` maps any of these onto one `Language`; each family then
picks its spelling (translation/conventions.py), and the checkpoint's tokenizer decides which it has.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Language:
    iso1: str | None  # ISO 639-1 (two letters), None where the language has none
    iso3: str  # ISO 639-3
    nllb: str  # NLLB-200's code: ISO 639-3 (its own choice of macrolanguage member) + script
    name: str  # English name, as T5's task prefixes spell it


# iso1 iso3 nllb name  (the languages of mBART-50, M2M100 and the most used of NLLB-200)
_TABLE = """
af afr afr_Latn Afrikaans
am amh amh_Ethi Amharic
ar ara arb_Arab Arabic
as asm asm_Beng Assamese
- ast ast_Latn Asturian
az aze azj_Latn Azerbaijani
ba bak bak_Cyrl Bashkir
be bel bel_Cyrl Belarusian
bg bul bul_Cyrl Bulgarian
bn ben ben_Beng Bengali
bs bos bos_Latn Bosnian
ca cat cat_Latn Catalan
- ceb ceb_Latn Cebuano
cs ces ces_Latn Czech
cy cym cym_Latn Welsh
da dan dan_Latn Danish
de deu deu_Latn German
el ell ell_Grek Greek
en eng eng_Latn English
eo epo epo_Latn Esperanto
es spa spa_Latn Spanish
et est est_Latn Estonian
eu eus eus_Latn Basque
fa fas pes_Arab Persian
ff ful fuv_Latn Fulah
fi fin fin_Latn Finnish
fo fao fao_Latn Faroese
fr fra fra_Latn French
fy fry fry_Latn Western Frisian
ga gle gle_Latn Irish
gd gla gla_Latn Scottish Gaelic
gl glg glg_Latn Galician
gu guj guj_Gujr Gujarati
ha hau hau_Latn Hausa
he heb heb_Hebr Hebrew
hi hin hin_Deva Hindi
hr hrv hrv_Latn Croatian
ht hat hat_Latn Haitian Creole
hu hun hun_Latn Hungarian
hy hye hye_Armn Armenian
id ind ind_Latn Indonesian
ig ibo ibo_Latn Igbo
- ilo ilo_Latn Ilocano
is isl isl_Latn Icelandic
it ita ita_Latn Italian
ja jpn jpn_Jpan Japanese
jv jav jav_Latn Javanese
ka kat kat_Geor Georgian
kk kaz kaz_Cyrl Kazakh
km khm khm_Khmr Khmer
kn kan kan_Knda Kannada
ko kor kor_Hang Korean
ky kir kir_Cyrl Kyrgyz
lb ltz ltz_Latn Luxembourgish
lg lug lug_Latn Ganda
ln lin lin_Latn Lingala
lo lao lao_Laoo Lao
lt lit lit_Latn Lithuanian
lv lav lvs_Latn Latvian
mg mlg plt_Latn Malagasy
mk mkd mkd_Cyrl Macedonian
ml mal mal_Mlym Malayalam
mn mon khk_Cyrl Mongolian
mr mar mar_Deva Marathi
ms msa zsm_Latn Malay
mt mlt mlt_Latn Maltese
my mya mya_Mymr Burmese
ne nep npi_Deva Nepali
nl nld nld_Latn Dutch
no nor nob_Latn Norwegian
- nso nso_Latn Northern Sotho
oc oci oci_Latn Occitan
or ori ory_Orya Oriya
pa pan pan_Guru Punjabi
pl pol pol_Latn Polish
ps pus pbt_Arab Pashto
pt por por_Latn Portuguese
ro ron ron_Latn Romanian
ru rus rus_Cyrl Russian
sd snd snd_Arab Sindhi
si sin sin_Sinh Sinhala
sk slk slk_Latn Slovak
sl slv slv_Latn Slovenian
so som som_Latn Somali
sq sqi als_Latn Albanian
sr srp srp_Cyrl Serbian
ss ssw ssw_Latn Swati
su sun sun_Latn Sundanese
sv swe swe_Latn Swedish
sw swa swh_Latn Swahili
ta tam tam_Taml Tamil
te tel tel_Telu Telugu
tg tgk tgk_Cyrl Tajik
th tha tha_Thai Thai
tl tgl tgl_Latn Tagalog
tn tsn tsn_Latn Tswana
tr tur tur_Latn Turkish
tt tat tat_Cyrl Tatar
uk ukr ukr_Cyrl Ukrainian
ur urd urd_Arab Urdu
uz uzb uzn_Latn Uzbek
vi vie vie_Latn Vietnamese
wo wol wol_Latn Wolof
xh xho xho_Latn Xhosa
yi yid ydd_Hebr Yiddish
yo yor yor_Latn Yoruba
zh zho zho_Hans Chinese
zu zul zul_Latn Zulu
"""


def _parse() -> list[Language]:
    out = []
    for line in _TABLE.strip().splitlines():
        iso1, iso3, nllb, name = line.split(maxsplit=3)
        out.append(Language(None if iso1 == "-" else iso1, iso3, nllb, name))
    return out


LANGUAGES: tuple[Language, ...] = tuple(_parse())
_BY_KEY: dict[str, Language] = {}
for _lang in LANGUAGES:
    for _key in (_lang.iso1, _lang.iso3, _lang.nllb, _lang.name):
        if _key is not None:
            _BY_KEY.setdefault(_key.lower(), _lang)
# ISO 639-3 codes of individual languages NLLB and OPUS-MT use where the table keeps the macrolanguage
_ALIASES = {"arb": "ar", "pes": "fa", "zsm": "ms", "swh": "sw", "npi": "ne", "khk": "mn", "lvs": "lv", "nob": "no",
            "als": "sq", "uzn": "uz", "pbt": "ps", "plt": "mg", "ydd": "yi", "azj": "az", "cmn": "zh", "ory": "or",
            "fuv": "ff", "nb": "no"}
for _alias, _target in _ALIASES.items():
    _BY_KEY.setdefault(_alias, _BY_KEY[_target])


def find_language(code: str) -> Language | None:
    """The language a user's code or name stands for (None when the table has no such language): ISO 639-1,
    ISO 639-3, NLLB's `xxx_Scrp`, an English name, or mBART-50's `xx_YY` (by its language part)."""
    key = code.strip().lower()
    if key in _BY_KEY:
        return _BY_KEY[key]
    if "_" in key:  # de_DE (mBART-50), zho_Hant (another script than the table's)
        return _BY_KEY.get(key.split("_")[0])
    return None
