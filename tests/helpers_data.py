"""Synthetic documents for the data-pipeline tests: random sentences over small vocabularies, so
no copied text is committed and distinct documents share no long n-grams."""

from __future__ import annotations

import random

BN_WORDS = ("আমি তুমি সে আমরা তোমরা তারা বাড়ি নদী আকাশ গাছ ফুল পাখি বই স্কুল শহর গ্রাম মানুষ জল "
            "মাটি আলো রাত দিন সকাল বিকেল সন্ধ্যা খাবার ভাত মাছ দুধ চা পথ মাঠ খেলা গান কথা চিঠি মেঘ "
            "বৃষ্টি রোদ হাওয়া সমুদ্র পাহাড় বন্ধু মা বাবা ভাই বোন শিক্ষক ছাত্র কাজ সময় বছর মাস সপ্তাহ "
            "নতুন পুরনো বড় ছোট সুন্দর ভালো লাল নীল সবুজ হলুদ যায় আসে দেখে বলে লেখে পড়ে খায় ঘুমায় হাসে").split()
EN_WORDS = ("the a river sky tree flower bird book school city village people water earth light night "
            "day morning evening food rice fish milk tea road field game song word letter cloud rain sun "
            "wind sea mountain friend mother father brother sister teacher student work time year month "
            "week new old big small beautiful good red blue green yellow goes comes sees says writes reads "
            "eats sleeps laughs under over near far quickly slowly often never always").split()


def sentence(rng: random.Random, words, n: int = 12) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def document(seed: int, language: str = "bn", sentences: int = 12) -> str:
    rng = random.Random(seed)
    words = BN_WORDS if language == "bn" else EN_WORDS
    end = "।" if language == "bn" else "."
    lines = [sentence(rng, words, rng.randint(9, 15)) + end for _ in range(sentences)]
    return "\n".join(" ".join(lines[i:i + 3]) for i in range(0, len(lines), 3))
