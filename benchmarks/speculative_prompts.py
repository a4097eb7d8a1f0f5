"""The prompts of `benchmarks/speculative.py`: chat requests whose answers copy from their input
(an edit, an extraction, a summary, a refactor of given code: what prompt lookup can draft), and
free generation (stories, open questions: what it cannot).

Each grounded text is a few hundred tokens, written for this benchmark; the answers run to
~128-256 tokens on SmolLM2-135M-Instruct.
"""

from __future__ import annotations

_CSV_LOADER = """import csv

def load_orders(path):
    f = open(path)
    reader = csv.reader(f)
    header = next(reader)
    orders = []
    for row in reader:
        if len(row) == 0:
            continue
        order = {}
        order["id"] = int(row[0])
        order["customer"] = row[1].strip()
        order["amount"] = float(row[2])
        order["currency"] = row[3].strip().upper()
        order["paid"] = row[4].strip().lower() == "yes"
        orders.append(order)
    f.close()
    return orders


def total_paid(orders, currency):
    total = 0
    for order in orders:
        if order["paid"] == True and order["currency"] == currency:
            total = total + order["amount"]
    return total


def customers_with_unpaid(orders):
    result = []
    for order in orders:
        if order["paid"] == False:
            if order["customer"] not in result:
                result.append(order["customer"])
    return result
"""

_JS_FETCH = """function loadUserProfile(userId, callback) {
  fetch('/api/users/' + userId)
    .then(function (response) {
      if (!response.ok) {
        throw new Error('HTTP ' + response.status);
      }
      return response.json();
    })
    .then(function (user) {
      return fetch('/api/users/' + userId + '/settings')
        .then(function (response) {
          return response.json();
        })
        .then(function (settings) {
          user.settings = settings;
          callback(null, user);
        });
    })
    .catch(function (error) {
      console.error('Could not load profile for ' + userId, error);
      callback(error, null);
    });
}
"""

_EMAIL = """Hi Sarah,

I wanted to follow up on are meeting from last tuesday about the new onboarding process. Me and
the rest of the team has been looking at the feedback from the last three hires, and their is a
clear pattern: most of them didnt get access to the build servers until there second week, which
meant they spend the first days reading documentation instead of doing real work. We think the
problem is that the access request goes to the IT queue and nobody own it.

Our proposal is that the hiring manager file the access request on the day the offer is signed,
not on the first day of work. We also want to give each new hire a buddy who have been on the team
for at least a year, and who will pair with them on there first ticket. The buddy should block two
hours a day for this during the first week.

Could you let me know if your okay with this before friday? If we agree, I will update the
onboarding checklist and send it to the managers next monday.

Thanks alot,
Daniel
"""

_MEETING = """Product sync, 14 March. Present: Priya (PM), Tom (backend), Lena (design), Marco (QA).

Priya opened with the release plan: version 2.4 is still planned for April 2, but the export
feature is at risk. Tom said the CSV export works, but the Excel export times out for reports
with more than 50,000 rows; he will move the export to a background job and expects to finish by
March 21. Lena showed the new settings page; everyone liked it, but Marco pointed out that the
save button is hidden on small screens. Lena will fix the layout for screens under 768 pixels by
March 18. Marco reported 12 open bugs, 3 of them critical, all in the billing module. Tom will
fix the two rounding bugs in invoices by March 19, and Marco will retest billing on March 20.
Priya will write the release notes by March 28 and ask the support team to review them. The team
agreed to skip the Friday demo this week. Next sync: 21 March.
"""

_ARTICLE = """The city council of Millbrook voted on Tuesday to turn the old railway depot on the east
side of town into a public library and community center. The depot, built in 1911, has been empty
since the last freight line closed in 1987, and several plans to demolish it failed over the
years because of its status as a protected building. The new plan keeps the brick walls and the
iron roof structure, and adds a glass entrance on the north side facing the river.

The project will cost 14.5 million dollars. About 9 million will come from a state grant for the
reuse of historic buildings, 3 million from the city budget, and the rest from private donors,
including a local bakery chain that pledged 800,000 dollars. Construction is expected to start in
September and to take about two years.

Supporters say the east side has had no library since 2009, when the branch on Elm Street closed,
and that children there travel more than forty minutes by bus to reach the main library. Critics
on the council argued that the city should first repair roads and the water system, and two
members voted against the plan. The final vote was seven to two. The mayor said the building will
also host after-school programs, a small cafe and a room for local history exhibitions.
"""

_LAPTOP = """The Aria 14 is a lightweight laptop for students and travelers. It weighs 1.2 kilograms and is
15.9 millimeters thick, with an aluminum body in silver or dark blue. The 14-inch screen has a
resolution of 2240 by 1400 pixels, a 90 Hz refresh rate and a peak brightness of 400 nits. Inside
there is an 8-core processor running at up to 4.7 GHz, 16 GB of memory and a 512 GB solid-state
drive; a model with 32 GB of memory and a 1 TB drive costs 200 dollars more. The battery holds 60
watt-hours, which the maker says lasts up to 14 hours of video playback, and the included 65-watt
charger fills it to 50 percent in 30 minutes. Ports are two USB-C, one USB-A, an HDMI output and a
headphone jack. The keyboard is backlit, the webcam records 1080p video, and the power button has a
fingerprint reader. The base model costs 899 dollars and ships from May 6.
"""

_CONFIG = """[server]
host = 0.0.0.0
port = 8080
workers = 4
timeout_seconds = 30

[database]
url = postgresql://app@db.internal:5432/orders
pool_size = 10
max_overflow = 5
echo = false

[cache]
backend = redis
url = redis://cache.internal:6379/0
default_ttl_seconds = 300

[logging]
level = INFO
format = json
file = /var/log/orders/app.log
"""

_STORY = """Mira had kept the lighthouse on Gull Island for eleven years. Every evening she climbed the
one hundred and twelve steps, cleaned the lens, and lit the lamp. Every morning she wrote the
weather in the logbook: the wind, the height of the waves, the ships that passed. In winter the
supply boat came only once a month, and she talked to the gulls more than to people.

One night in November a storm broke the radio antenna. Around midnight Mira saw a small fishing
boat drifting toward the rocks on the north side, its engine dead. She could not call the coast
guard. She took the big signal lamp, ran down to the cliff, and flashed the old code her father
had taught her, showing the boat the narrow channel between the rocks. The boat turned slowly,
found the channel, and reached the calm water of the bay an hour later.

In the morning two fishermen knocked on her door with a basket of fish and a bottle of wine. They
said they had almost given up. Mira made them tea, fixed the antenna by noon, and wrote in the
logbook: wind north-west, force nine, one boat guided in.
"""

# name -> the user's message
GROUNDED: dict[str, str] = {
    "refactor_python": "Refactor this Python code: use a `with` statement, add type hints, and replace "
    "`== True`/`== False` with plain conditions. "
    "Reply with the whole refactored code only.\n\n```python\n" + _CSV_LOADER + "```",
    "refactor_js": "Rewrite this JavaScript function with async/await instead of promise chains, "
    "keeping its behaviour and names. Reply with the code only.\n\n```javascript\n" + _JS_FETCH + "```",
    "fix_email": "Correct the spelling and grammar mistakes in this email. Keep everything else "
    "exactly as it is and reply with the corrected email only.\n\n" + _EMAIL,
    "extract_actions": "From these meeting notes, list every action item as a bullet: who, what, and "
    "by when, using the notes' own words.\n\n" + _MEETING,
    "summarise_article": "Summarise this news article in one paragraph, keeping the numbers.\n\n" + _ARTICLE,
    "extract_specs": "Extract the technical specifications of this laptop as a Markdown table with "
    "two columns, Specification and Value.\n\n" + _LAPTOP,
    "ini_to_yaml": "Convert this INI configuration file to YAML, keeping every section, key and "
    "value. Reply with the YAML only.\n\n```ini\n" + _CONFIG + "```",
    "story_past_to_present": "Rewrite this story in the present tense, changing nothing else.\n\n" + _STORY,
}

FREE: dict[str, str] = {
    "story": "Write a short story about a robot who learns to paint.",
    "remote_work": "What are the advantages and disadvantages of working from home?",
    "sky": "Explain to a ten-year-old why the sky is blue and sunsets are red.",
    "plan_trip": "Suggest a plan for a three-day trip to the mountains in autumn.",
}
