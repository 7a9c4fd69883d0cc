#!/usr/bin/env python3
"""Write conf/data/sample_conversations.jsonl, the sample dataset of hidden-harvest.
Deterministic (random.Random(1234), and random.Random(99) for the agentic rows), stdlib only, no network:
rerunning reproduces the file byte for byte. Rows mix every accepted shape (chat "messages", ShareGPT
"conversations", pre-tokenized "input_ids", plain "text") plus four deliberately bad rows (ids "bad-*")
for the error handling. Some multi-turn chats carry reasoning (`reasoning_content`, or its alias
`reasoning`, or inline <think> in the content) and some call tools (a row-level `tools` list, assistant
`tool_calls`, `tool` messages with `tool_call_id`), as the data of reasoning and agentic targets does.
Conversations run from a few tokens up to ~2,000 tokens (1 token ~ 4 characters).
"""

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "conf" / "data" / "sample_conversations.jsonl"
MAX_CHARS = 8800  # ~2,200 tokens: hard ceiling for any single conversation

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly and concise assistant. Answer clearly and avoid unnecessary jargon.",
    "You are a patient tutor. Explain ideas step by step and check for understanding.",
    "You are an expert assistant. Be accurate, and say so when you are unsure.",
]
GREETINGS = ["hi", "hello", "hey", "Hi there!", "good morning", "hey, you there?", "Hello!"]
GREETING_REPLIES = ["Hello! How can I help?", "Hi! What can I do for you today?", "Hey there! What's on your mind?"]
PREFIXES = ["", "", "", "Hi! ", "Quick question: ", "I've been wondering about something. ", "Hello. "]
SWITCHES = [
    "Thanks! Different topic: ",
    "Switching gears. ",
    "Great, thank you. Another question: ",
    "Unrelated question. ",
    "That helps. Now something else: ",
]
FOLLOWUPS = [
    "Can you go into more detail?",
    "Could you give me a concrete example?",
    "Interesting, why is that?",
    "What mistakes do beginners usually make here?",
    "Thanks. Anything else I should know?",
]
OPENERS = ["Sure!", "Good question.", "Happy to help.", "Here's how I'd think about it.", "Of course."]
CLOSERS = ["Let me know if you'd like more detail on any of these points.", "Hope that helps!"]

# topic -> (questions, answer sentences); LEADS[topic][i] is the sentence that best answers question i
LEADS = {
    "programming": (0, 3, 5),
    "cooking": (0, 4, 6),
    "history": (0, 2, 4),
    "math": (0, 1, 3),
    "travel": (0, 1, 4),
    "science": (1, 2, 4),
    "writing": (0, 1, 3),
    "fitness": (0, 2, 3),
    "music": (0, 2, 5),
    "gardening": (1, 2, 5),
}
TOPICS = {
    "programming": (
        [
            "How should I approach debugging a bug I can't reproduce consistently?",
            "What makes Python code easy to maintain?",
            "My script is slow. Where should I start?",
        ],
        [
            "A good first step when debugging is to reproduce the problem reliably, ideally with the smallest input that still triggers it, because a fast repro makes every later experiment cheaper.",
            "Write the failing case down as a test before you touch the code; once it passes you know the fix works, and the test keeps the bug from quietly coming back later.",
            "In Python, a list comprehension is usually clearer than a loop that appends to a list, but once it needs nested conditions a plain for loop is often easier to read.",
            "Prefer small functions with descriptive names over long comments: a name like parse_header tells the reader what happens, while a comment can drift out of date.",
            "Version control pays off even on solo projects, since small focused commits with clear messages let you bisect a regression instead of guessing where it came from.",
            "When a program is slow, measure before optimizing; a profiler often shows that most of the time goes into one unexpected spot, such as repeated file reads inside a loop.",
            "Type hints do not change how Python runs, but they let editors and checkers like mypy catch mismatched arguments long before the code reaches production.",
            "Handle errors at the level that can actually do something about them, and let the rest propagate with enough context that the final message explains what went wrong.",
        ],
    ),
    "cooking": (
        [
            "How do I get a better sear on chicken thighs?",
            "Why does my homemade bread come out dense?",
            "Any tips for making weeknight dinners less stressful?",
        ],
        [
            "For a crisp crust on meat or vegetables, pat them dry and make sure the pan is properly hot before anything goes in, because surface moisture turns searing into steaming.",
            "Salt pasta water generously, roughly like mild seawater, because pasta absorbs it as it cooks and no amount of salt in the sauce fully makes up for bland noodles.",
            "A splash of acid such as lemon juice or vinegar at the end brightens a heavy stew or soup, often more effectively than adding yet another pinch of salt.",
            "Let roasted meat rest for several minutes before slicing so the juices redistribute; cutting straight away leaves a puddle on the board and noticeably drier slices.",
            "Bread dough is ready for shaping when it has roughly doubled and springs back slowly after a gentle poke, which matters more than the exact time printed in the recipe.",
            "A classic French vinaigrette is about three parts oil to one part vinegar, with a spoon of Dijon mustard to help it emulsify and a little minced shallot for sharpness.",
            "Mise en place, meaning everything chopped, measured, and within reach before the stove goes on, makes fast dishes like stir-fries calm instead of frantic.",
            "Crème brûlée needs a gentle oven and a water bath so the custard sets evenly, and the sugar on top is caramelized with a torch just before it is served.",
        ],
    ),
    "history": (
        [
            "Why was the printing press such a big deal?",
            "What caused the fall of the Roman Republic?",
            "How do historians decide whether a source is reliable?",
        ],
        [
            "The printing press, developed by Johannes Gutenberg around 1450, made books far cheaper to produce and helped new ideas spread quickly across Europe within a few decades.",
            "The Silk Road was not a single road but a network of overland and maritime routes that carried silk, spices, religions, and technologies between China and the Mediterranean.",
            "The Roman Republic relied on elected magistrates and a powerful Senate, and its slow collapse into an empire played out over decades of political violence and civil war.",
            "The Industrial Revolution began in Britain in the late eighteenth century, driven by coal, steam power, and new textile machinery that moved work from homes into factories.",
            "Historians treat primary sources such as letters, ledgers, and court records with care, asking who wrote them, for whom, and what the author might have chosen to leave out.",
            "The Black Death of the fourteenth century killed a large share of Europe's population, and the labor shortages that followed reshaped wages, rents, and land ownership.",
            "The Meiji Restoration of 1868 began a period of rapid modernization in Japan, with new railways, a conscript army, and a written constitution adopted in 1889.",
            "Egyptian hieroglyphs were deciphered in the 1820s largely thanks to the Rosetta Stone, which carried the same decree in hieroglyphic, Demotic, and ancient Greek script.",
        ],
    ),
    "math": (
        [
            "Can you explain proof by induction simply?",
            "What does a derivative actually mean?",
            "What's the chance of rolling a seven with two dice?",
        ],
        [
            "A proof by induction first shows that a statement holds for a base case, and then shows that whenever it holds for some n, it must also hold for n + 1.",
            "The derivative measures how fast a function changes at a point; geometrically it is the slope of the tangent line that just touches the curve at that point.",
            "To add fractions with different denominators, rewrite them over a common denominator first, so 1/3 + 1/4 becomes 4/12 + 3/12, which equals 7/12.",
            "Probability questions get easier when you write out the sample space explicitly; with two dice there are 36 equally likely outcomes, and six of them sum to seven.",
            "A matrix can be read as a linear transformation, so multiplying two matrices corresponds to applying one transformation and then the other, in a specific order.",
            "The Pythagorean theorem says that in a right triangle the square of the hypotenuse equals the sum of the squares of the other two sides, as in 3² + 4² = 5².",
            "When a word problem feels overwhelming, name the unknowns, write down every relationship the text gives you, and only then start solving the resulting equations.",
            "The mean is sensitive to outliers while the median is not, which is why reports on household income or house prices usually quote the median instead.",
        ],
    ),
    "travel": (
        [
            "I'm visiting Japan for two weeks. Is a rail pass worth it?",
            "How can I pack light for a ten-day trip?",
            "What's the best way to deal with jet lag?",
        ],
        [
            "For a first trip to Japan, a rail pass can be worth it if you plan several long journeys, but city-focused trips are usually cheaper with a rechargeable IC card.",
            "Pack layers rather than bulky items; a light sweater and a waterproof shell cover a surprising range of weather and still leave room in a carry-on bag.",
            "Keep digital and paper copies of your passport and insurance details separate from the originals, so that losing one bag does not mean losing everything.",
            "In Lisbon the steep hills and tram 28 are famous, but walking through the Alfama district early in the morning is the best way to enjoy it before the crowds arrive.",
            "Jet lag usually eases faster if you switch to local meal times right away and spend some time outside in daylight on your first day at the destination.",
            "Learning a handful of phrases such as hello, please, thank you, and excuse me in the local language goes a long way with the people you meet along the way.",
            "Overnight trains can save both a night of accommodation and half a day of travel, and routes like Vienna to Venice are comfortable in a sleeper cabin.",
            "Check whether your destination requires an electronic travel authorization before departure, since some of them must be approved several days in advance.",
        ],
    ),
    "science": (
        ["Why is the sky blue?", "How do vaccines actually work?", "What makes an experiment well designed?"],
        [
            "Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide and water and, using sunlight, produce glucose and release oxygen.",
            "The sky looks blue because air molecules scatter short blue wavelengths of sunlight much more strongly than longer red ones, an effect known as Rayleigh scattering.",
            "Vaccines train the immune system by exposing it to a harmless piece or weakened version of a pathogen, so it can respond much faster if the real thing ever appears.",
            "Plate tectonics explains earthquakes, volcanoes, and mountain ranges as the result of large slabs of the Earth's lithosphere slowly grinding against one another.",
            "A good experiment changes one variable at a time and includes a control group, otherwise it is hard to tell which change actually caused the effect you observed.",
            "DNA stores genetic information in sequences of four bases, and the way those bases pair, A with T and C with G, is what allows the molecule to be copied accurately.",
            "Water expands when it freezes, which is why ice floats and why lakes freeze from the top down, insulating the water and the life beneath the surface.",
            "Light from the Sun takes a little over eight minutes to reach Earth, so whenever we look at the Sun we are seeing it as it was slightly in the past.",
        ],
    ),
    "writing": (
        [
            "Can you help me make my cover letter stronger?",
            "How do I make my writing more concise?",
            "What's a good way to edit my own drafts?",
        ],
        [
            "Start a cover letter with what you can do for the team rather than with your life story, because the first two sentences decide whether the reader keeps going.",
            "Cut words that do not earn their place: 'in order to' is usually just 'to', 'at this point in time' is 'now', and 'very unique' is simply 'unique'.",
            "Active voice generally reads more clearly than passive voice, since it tells the reader who did what, as in 'the committee approved the plan' instead of 'the plan was approved'.",
            "When revising, read the draft aloud; sentences that trip you up or leave you out of breath usually need to be split, reordered, or simplified.",
            "A strong paragraph has one main idea, stated early, with the remaining sentences supporting or developing it rather than wandering off toward new points.",
            "For an email that needs action, put the request and the deadline in the first lines and leave the background for afterwards, for anyone who wants it.",
            "Show, don't tell is useful advice for fiction: instead of saying a character was nervous, describe her folding the same receipt over and over again.",
            "Keep a consistent tense and point of view throughout a piece unless you are shifting deliberately, because accidental switches quietly confuse readers.",
        ],
    ),
    "fitness": (
        [
            "I'm new to the gym. What routine should I start with?",
            "How much sleep do I really need?",
            "Is walking enough exercise?",
        ],
        [
            "For beginners, two or three full-body strength sessions a week built on basic movements like squats, push-ups, and rows give you a solid foundation.",
            "Progress comes from gradually increasing the challenge, whether that means a little more weight, a few more repetitions, or slower and more controlled movement.",
            "Most adults do well with seven to nine hours of sleep a night, and keeping a consistent bedtime often helps more than any supplement or gadget.",
            "A brisk daily walk is one of the simplest habits for heart health, and it is easy to build into a commute, a phone call, or a lunch break.",
            "Warm up with a few minutes of light movement before intense exercise; it raises your heart rate gradually and makes the first working sets feel much better.",
            "Drink water regularly through the day, and a bit more in hot weather or during long workouts, rather than trying to catch up all at once in the evening.",
            "Rest days are part of training, because muscles adapt and get stronger during recovery rather than during the workout itself.",
            "If a movement causes sharp pain rather than ordinary effort, stop and consider talking to a doctor or physiotherapist before you continue with it.",
        ],
    ),
    "music": (
        [
            "How should I structure my guitar practice?",
            "What's the difference between major and minor chords?",
            "Why do so many pop songs sound alike?",
        ],
        [
            "When learning an instrument, short daily practice sessions of fifteen to twenty minutes usually beat a single long session squeezed in once a week.",
            "Practicing a difficult passage slowly with a metronome, then raising the tempo a few beats at a time, builds accuracy that still holds up at full speed.",
            "A major chord is built from the root, the major third, and the perfect fifth, so C major contains C, E, and G, while C minor lowers the third to E♭.",
            "Ear training, such as singing intervals or picking out simple melodies by ear, makes it much easier to learn new songs and eventually to improvise.",
            "Recording yourself is uncomfortable at first, but it reveals timing and tone problems that you simply cannot hear while you are busy playing.",
            "Many popular songs rely on the same four chords, I–V–vi–IV, which is why so many different melodies seem to fit over a single progression.",
            "On guitar, switching between chords cleanly matters more than strumming fast, so practice the change itself until your fingers find the shape automatically.",
            "Listening actively, for example following only the bass line or the drums for a whole song, is a good way to understand how an arrangement is built.",
        ],
    ),
    "gardening": (
        [
            "How often should I water my vegetable garden?",
            "How can I improve clay soil?",
            "What herbs are easy to grow on a balcony?",
        ],
        [
            "Most vegetables need at least six hours of direct sun a day, so watch where the light falls in your garden for a few days before deciding where to plant.",
            "Water deeply and less often rather than a little every day; this encourages roots to grow downward, where the soil stays moist for longer.",
            "Adding compost improves almost any soil, helping sandy soil hold on to water and helping heavy clay drain better and crumble more easily.",
            "Tomatoes appreciate consistent watering, and uneven moisture is a common cause of blossom end rot and of fruit that splits just before it ripens.",
            "Mulching around plants with straw or wood chips keeps the soil cool, holds moisture in during dry spells, and suppresses many annual weeds.",
            "Herbs like basil, thyme, and mint grow well in containers, and mint in particular is best kept in a pot so that it does not take over an entire bed.",
            "Rotating crops each season, rather than planting the same family in the same spot, reduces the build-up of soil-borne pests and diseases.",
            "Check the average last frost date for your area before setting out tender seedlings, and harden them off outdoors for about a week first.",
        ],
    ),
}
CODE = [
    '```python\ndef test_parse_empty_header():\n    # Reproduces the bug: an empty header used to raise KeyError.\n    assert parse_header("") == {}\n```',
    '```python\nimport cProfile\nimport pstats\n\ncProfile.run("main()", "profile.out")\nstats = pstats.Stats("profile.out")\nstats.sort_stats("cumulative").print_stats(10)\n```',
    "```python\n# Loop version\nsquares = []\nfor n in range(10):\n    if n % 2 == 0:\n        squares.append(n * n)\n\n# Comprehension version\nsquares = [n * n for n in range(10) if n % 2 == 0]\n```",
    "```bash\ngit bisect start\ngit bisect bad HEAD\ngit bisect good v1.2.0\n# git checks out a commit; test it, then mark it:\ngit bisect good   # or: git bisect bad\n```",
]
SPECIALS = [  # hand-written edge cases, all valid
    [
        ("user", "How do I say 'thank you' in a few languages? Please include the original scripts."),
        (
            "assistant",
            "Of course! 🌍\n\n- French: merci (or « merci beaucoup »)\n- Spanish: ¡muchas gracias!\n- German: danke schön\n"
            "- Portuguese: obrigado / obrigada\n- Japanese: ありがとう (arigatō)\n- Chinese: 谢谢 (xièxie)\n- Korean: 감사합니다 (gamsahamnida)\n"
            "- Greek: ευχαριστώ (efcharistó)\n- Russian: спасибо (spasíbo)\n\nA smile 😊 works everywhere, too.",
        ),
    ],
    [
        ("system", "Follow the user's formatting instructions exactly."),
        ("user", "I'll paste the document in my next message. Reply with just 'OK.' if you understand."),
        ("assistant", "OK."),
    ],
    [
        ("user", "What's the capital of Australia?"),
        ("assistant", "The capital of Australia is Canberra."),
        (
            "assistant",
            "A common mix-up is Sydney, the largest city, but Canberra was purpose-built as the capital "
            "and has been the seat of government since 1927.",
        ),
        ("user", "Thanks!"),
        ("assistant", "You're welcome! 🙂"),
    ],
    [
        (
            "user",
            "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
        ),
        (
            "assistant",
            "Here's a compact version:\n\n```python\ndef is_palindrome(text: str) -> bool:\n"
            "    cleaned = [c.lower() for c in text if c.isalnum()]\n    return cleaned == cleaned[::-1]\n\n\n"
            'print(is_palindrome("A man, a plan, a canal: Panama"))  # True\n```\n\n'
            "It keeps only letters and digits, lowercases them, and compares the list with its reverse.",
        ),
        ("user", "And in JavaScript?"),
        (
            "assistant",
            '```javascript\nfunction isPalindrome(text) {\n  const cleaned = text.toLowerCase().replace(/[^a-z0-9]/g, "");\n'
            '  return cleaned === [...cleaned].reverse().join("");\n}\n```',
        ),
    ],
    [
        ("user", "Is it spelled 'resume' or 'résumé'? And what about 'naive' vs 'naïve', 'cafe' vs 'café'?"),
        (
            "assistant",
            "Both forms are accepted in English. 'Résumé' (or 'resumé') keeps the accents to distinguish it from "
            "the verb 'resume'; 'naïve' and 'café' are common in British and formal writing, while 'naive' and 'cafe' are "
            "perfectly fine elsewhere. Just pick one style — and stay consistent ✍️.",
        ),
    ],
]
BAD_ROWS = [
    {
        "id": "bad-no-assistant",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Can you summarize the plot of Hamlet?"},
        ],
    },
    {"id": "bad-shape", "foo": 1},
    {"id": "bad-empty-messages", "messages": []},
    {
        "id": "bad-unknown-role",
        "messages": [
            {"role": "user", "content": "Beep boop, who am I talking to?"},
            {"role": "robot", "content": "BEEP. I AM A ROBOT."},
            {"role": "assistant", "content": "I'm an AI assistant. How can I help?"},
        ],
    },
]


TOOLS = {
    "get_weather": ("Current weather for a city", {"city": "string"}),
    "convert_currency": (
        "Convert an amount between two currencies",
        {"amount": "number", "from": "string", "to": "string"},
    ),
    "search_docs": ("Search the project documentation", {"query": "string"}),
}
TOOL_TASKS = [  # (question, tool, arguments, result, answer)
    (
        "What's the weather like in Lisbon right now?",
        "get_weather",
        {"city": "Lisbon"},
        {"temperature_c": 21, "conditions": "sunny", "wind_kmh": 12},
        "It's 21 °C and sunny in Lisbon, with a light breeze of 12 km/h.",
    ),
    (
        "Is it raining in Oslo?",
        "get_weather",
        {"city": "Oslo"},
        {"temperature_c": 6, "conditions": "light rain", "wind_kmh": 20},
        "Yes, there's light rain in Oslo at the moment, 6 °C with a 20 km/h wind.",
    ),
    (
        "How much is 250 US dollars in euros?",
        "convert_currency",
        {"amount": 250, "from": "USD", "to": "EUR"},
        {"amount": 231.4, "currency": "EUR", "rate": 0.9256},
        "250 USD is about 231.40 EUR at the current rate of 0.9256.",
    ),
    (
        "Convert 1,000 yen to British pounds, please.",
        "convert_currency",
        {"amount": 1000, "from": "JPY", "to": "GBP"},
        {"amount": 5.21, "currency": "GBP", "rate": 0.00521},
        "1,000 JPY comes to roughly 5.21 GBP.",
    ),
    (
        "How do I resume an interrupted run?",
        "search_docs",
        {"query": "resume interrupted run"},
        {"hits": ["Rerun the same command: committed samples are skipped."]},
        "Just rerun the same command. Samples that were already committed are skipped, so the run picks up where it stopped.",
    ),
    (
        "Where does the output manifest live?",
        "search_docs",
        {"query": "manifest location"},
        {"hits": ["manifest.json sits at the root of the output directory."]},
        "The manifest is `manifest.json`, at the root of the output directory.",
    ),
]
THOUGHTS = [
    "The user wants {q} I know this well enough to answer directly, so I'll keep it short and concrete.",
    "Let me think about what matters most here: {q} A clear first point, then one practical tip.",
    "They ask: {q} I should lead with the direct answer and then add one useful detail.",
]


def tool_schema(name):
    desc, params = TOOLS[name]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in params.items()},
                "required": list(params),
            },
        },
    }


def reasoning_chat(rng, n):
    """A multi-turn chat whose assistant turns carry their reasoning, in one of the shapes datasets use."""
    style = ["reasoning_content", "reasoning", "inline"][n % 3]
    topics = rng.sample(list(TOPICS), 2)
    msgs = [msg("system", rng.choice(SYSTEM_PROMPTS))] if n % 2 else []
    for topic in topics:
        q = rng.choice(TOPICS[topic][0])
        thought = rng.choice(THOUGHTS).format(q=q[0].lower() + q[1:])
        a = " ".join(rng.sample(TOPICS[topic][1], 2))
        msgs.append(msg("user", q))
        if style == "inline":
            msgs.append(msg("assistant", f"<think>\n{thought}\n</think>\n\n{a}"))
        else:
            msgs.append({"role": "assistant", style: thought, "content": a})
    return msgs


def tool_chat(rng, n):
    """An agentic chat: a tool call with its reasoning, the tool's answer, the final answer, maybe a follow-up."""
    q, name, args, result, answer = TOOL_TASKS[n % len(TOOL_TASKS)]
    call_id = f"call_{n:03d}"
    msgs = [
        msg("user", q),
        {
            "role": "assistant",
            "content": "Let me look that up.",
            "reasoning_content": f"I need live data for this, so I'll call {name}.",
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "name": name, "content": json.dumps(result)},
        {
            "role": "assistant",
            "content": answer,
            "reasoning_content": f"The tool returned {json.dumps(result)}; I'll report it plainly.",
        },
    ]
    if rng.random() < 0.5:
        msgs += [
            msg("user", rng.choice(["Thanks!", "Great, thank you.", "Perfect."])),
            msg("assistant", rng.choice(["You're welcome!", "Glad I could help.", "Any time!"])),
        ]
    tools = [tool_schema(t) for t in sorted({name, *rng.sample(sorted(TOOLS), 1)})]
    return msgs, tools


def msg(role, content):
    return {"role": role, "content": content}


def answer(rng, topic, bag, budget, codes):
    """Assistant reply of roughly `budget` characters, drawing sentences from `bag`."""
    code = codes.pop() if topic == "programming" and codes and budget > 600 and rng.random() < 0.6 else None
    budget -= len(code) if code else 0
    sents = []
    while bag and (not sents or sum(len(s) + 1 for s in sents) < budget):
        sents.append(bag.pop())
    if len(sents) >= 3 and rng.random() < 0.25:
        body = "\n".join("- " + s for s in sents)
    else:
        cuts = [0]  # paragraphs of 2-4 sentences
        while cuts[-1] < len(sents):
            cuts.append(cuts[-1] + rng.randint(2, 4))
        body = "\n\n".join(" ".join(sents[i:j]) for i, j in zip(cuts, cuts[1:]))
    parts = ([rng.choice(OPENERS)] if rng.random() < 0.5 else []) + [body]
    if code:
        parts.insert(len(parts) - 1 if rng.random() < 0.5 else len(parts), "For example:\n\n" + code)
    if rng.random() < 0.3:
        parts.append(rng.choice(CLOSERS))
    return "\n\n".join(parts)


def conversation(rng, target):
    """A user/assistant conversation of roughly `target` characters (1-6 exchanges)."""
    bags = {t: rng.sample(s, len(s)) for t, (_, s) in TOPICS.items()}
    questions = {t: rng.sample(list(zip(q, LEADS[t])), len(q)) for t, (q, _) in TOPICS.items()}
    codes = rng.sample(CODE, len(CODE))
    order = rng.sample(list(TOPICS), len(TOPICS))
    topic = order.pop()
    msgs = [msg("system", rng.choice(SYSTEM_PROMPTS))] if rng.random() < 0.25 else []
    turns = min(6, max(-(-target // 1300), rng.randint(1, 1 + target // 1000)))
    total = sum(len(m["content"]) for m in msgs)
    for turn in range(turns):
        budget = (target - total) / (turns - turn)
        lead = None
        if turn > 0 and sum(map(len, bags[topic])) >= budget and rng.random() < 0.7:
            q = rng.choice(FOLLOWUPS)
            if questions[topic] and rng.random() < 0.4:
                q, lead = questions[topic].pop()
        else:
            topic = order.pop() if turn else topic
            q, lead = questions[topic].pop()
            q = rng.choice(SWITCHES if turn else PREFIXES) + q
        if lead is not None and TOPICS[topic][1][lead] in bags[topic]:  # answer the question first
            bags[topic].remove(TOPICS[topic][1][lead])
            bags[topic].append(TOPICS[topic][1][lead])
        a = answer(rng, topic, bags[topic], budget - len(q), codes)
        msgs += [msg("user", q), msg("assistant", a)]
        total += len(q) + len(a)
    return msgs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rng = random.Random(1234)
    seen = set()

    def unique(msgs):  # no duplicate conversations anywhere in the file
        key = tuple((m["role"], m["content"]) for m in msgs)
        new = key not in seen
        seen.add(key)
        return new

    def generate(target):
        while True:
            msgs = conversation(rng, target)
            if unique(msgs):
                return msgs

    chats = []
    while len(chats) < 14:  # tiny: a few tokens each
        msgs = [msg("user", rng.choice(GREETINGS)), msg("assistant", rng.choice(GREETING_REPLIES))]
        if unique(msgs):
            chats.append(msgs)
    chats += [[msg(r, c) for r, c in special] for special in SPECIALS]
    assert all(unique(c) for c in chats[-len(SPECIALS) :])
    targets = (
        [rng.randint(80, 800) for _ in range(30)]
        + [rng.randint(800, 6000) for _ in range(140)]
        + [rng.randint(6000, 7200) for _ in range(22)]
        + [rng.randint(7200, 7700) for _ in range(8)]
    )
    chats += [generate(t) for t in targets]
    rows = [{"messages": m} for m in chats]

    role_map = {"system": "system", "user": "human", "assistant": "gpt"}
    for _ in range(20):  # ShareGPT shape, no id: the pipeline derives one from content
        msgs = generate(rng.randint(100, 5000))
        rows.append({"conversations": [{"from": role_map[m["role"]], "value": m["content"]} for m in msgs]})

    for n, length in enumerate([20, 57, 133, 214, 300], start=1):  # pre-tokenized
        row = {"id": f"pretok-{n:04d}", "input_ids": [rng.randint(1, 49151) for _ in range(length)]}
        if n <= 3:
            prompt = rng.randint(length // 4, length // 2)
            row["loss_mask"] = [0] * prompt + [1] * (length - prompt)
        rows.append(row)

    for n, topic in enumerate(rng.sample(list(TOPICS), 5), start=1):  # plain text
        sents = rng.sample(TOPICS[topic][1], rng.randint(3, 7))
        text = " ".join(sents[:3]) + ("\n\n" + " ".join(sents[3:]) if len(sents) > 3 else "")
        rows.append({"id": f"text-{n:04d}", "text": text} if n <= 2 else {"text": text})

    agentic = random.Random(99)  # its own stream, so the rows above stay as they were
    rows += [{"messages": reasoning_chat(agentic, n)} for n in range(12)]
    for n in range(10):
        msgs, tools = tool_chat(agentic, n)
        rows.append({"messages": msgs, "tools": tools})

    rng.shuffle(rows)
    with_id = set(rng.sample([i for i, r in enumerate(rows) if "messages" in r], len(chats) // 2))
    for n, i in enumerate(sorted(with_id), start=1):
        rows[i] = {"id": f"conv-{n:04d}", **rows[i]}
    for pos, bad in zip([11, 67, 139, 203], BAD_ROWS):  # scattered deliberately bad rows
        rows.insert(pos, bad)

    for turns in (r.get("messages") or r.get("conversations") or [] for r in rows):
        assert sum(len(m.get("content", m.get("value", ""))) for m in turns) <= MAX_CHARS
    ids = [r["id"] for r in rows if "id" in r]
    assert len(ids) == len(set(ids))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
