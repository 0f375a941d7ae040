//! Essays from templates: argumentative student essays with labelled discourse elements, in
//! the Feedback Prize's seven classes, cut into candidate segments that over-split them.
//!
//! An essay takes a topic (12), a stance (for or against), and a structure: an optional Lead,
//! a Position, one to three Claims each followed (mostly) by Evidence, an optional
//! Counterclaim with its Rebuttal, and a Concluding Statement; a salutation or a closing line
//! outside every element now and then. Each element is one to three sentences; a sentence is
//! an *opener* (a cue such as "For example," or "Some people say that") joined to a *core*
//! (a clause with the topic's slots filled in).
//!
//! **Held-out essays use combinations training never shows**: a sentence's (opener, core) pair
//! is held out when `(opener + core) mod 3 == 0` and appears only in held-out essays; training
//! essays use the other pairs. Every opener and every core is seen in training, never together
//! with the held-out partners, so memorising sentences fails and reading the cue works.
//!
//! **Segments** split every sentence at its end, and at a clause boundary (a comma, "because",
//! "which", "and") with probability 0.7 when both halves keep at least three words: about two
//! segments per element, as in the source, where segments were cut wherever an element might
//! begin. Element boundaries are always segment boundaries.
//!
//! **Label noise**: a later sentence of a multi-sentence element is annotated as a new element
//! of the same class with probability [`ANNOTATOR_SPLIT_P`]; nothing in the text says so.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{Essay, Segment, NONE};

/// A topic and its fillers.
struct Topic {
    /// The issue, as a noun phrase that takes a verb ("phones in class").
    name: &'static str,
    /// Who it concerns.
    group: &'static str,
    /// Reasons for (verb phrases: "help students look things up").
    pros: [&'static str; 4],
    /// Reasons against.
    cons: [&'static str; 4],
    /// Things that happened (clauses).
    examples: [&'static str; 4],
}

const TOPICS: [Topic; 12] = [
    Topic {
        name: "phones in class",
        group: "students",
        pros: [
            "help students look things up fast",
            "keep students safe in an emergency",
            "let students use learning apps",
            "teach students to manage their time",
        ],
        cons: [
            "distract students from the lesson",
            "make cheating on tests easy",
            "lead to bullying online",
            "waste time that should be spent learning",
        ],
        examples: [
            "my friend looked up a word during science",
            "a student called home when the bus broke down",
            "our teacher used a quiz app last week",
            "my cousin checked social media all through math",
        ],
    },
    Topic {
        name: "online classes",
        group: "students",
        pros: [
            "let students learn at their own pace",
            "save hours of travel",
            "help students who are sick",
            "give access to more courses",
        ],
        cons: [
            "leave students feeling alone",
            "make it hard to ask questions",
            "depend on a good internet connection",
            "make it easy to stop paying attention",
        ],
        examples: [
            "my sister took a coding course from home",
            "I missed a week of school with the flu",
            "our school offered Chinese only online",
            "my neighbor lost his connection during an exam",
        ],
    },
    Topic {
        name: "a four-day school week",
        group: "families",
        pros: [
            "give students time to rest",
            "save the school money on buses",
            "let students work part-time jobs",
            "improve teacher morale",
        ],
        cons: [
            "make the other days too long",
            "leave young children without care",
            "reduce the time spent learning",
            "hurt students who need school meals",
        ],
        examples: [
            "a district in Colorado tried it for two years",
            "my aunt had to pay for extra daycare",
            "students in one town said they slept more",
            "our principal talked about it at a meeting",
        ],
    },
    Topic {
        name: "community service",
        group: "teenagers",
        pros: [
            "teach young people responsibility",
            "help neighborhoods in need",
            "build skills for future jobs",
            "connect people of different ages",
        ],
        cons: [
            "take time away from homework",
            "feel like forced labor",
            "be hard for students with jobs",
            "turn kindness into a chore",
        ],
        examples: [
            "my class cleaned the park last spring",
            "I tutored younger kids at the library",
            "my brother volunteered at a food bank",
            "a friend had to skip practice for service hours",
        ],
    },
    Topic {
        name: "extracurricular activities",
        group: "students",
        pros: [
            "help students make friends",
            "teach teamwork",
            "look good on college applications",
            "keep students active",
        ],
        cons: [
            "overload busy students",
            "cost families money",
            "take time from studying",
            "exclude students who work after school",
        ],
        examples: [
            "I joined the debate club in ninth grade",
            "my friend quit soccer to keep her grades up",
            "our robotics team won a state award",
            "my parents paid for band trips",
        ],
    },
    Topic {
        name: "driverless cars",
        group: "drivers",
        pros: [
            "reduce accidents caused by tired drivers",
            "help people who cannot drive",
            "cut traffic jams",
            "save time on long trips",
        ],
        cons: [
            "fail in bad weather",
            "cost too much for most families",
            "take jobs from truck drivers",
            "raise hard questions about blame",
        ],
        examples: [
            "a test car drove across the country",
            "my grandfather stopped driving last year",
            "a self-driving car crashed in the rain",
            "a company tested robot trucks on highways",
        ],
    },
    Topic {
        name: "exploring Venus",
        group: "scientists",
        pros: [
            "teach us how planets change",
            "push new technology forward",
            "show us what could happen to Earth",
            "inspire young people to study science",
        ],
        cons: [
            "put expensive machines at risk",
            "cost money needed on Earth",
            "be too dangerous for people",
            "produce little useful data",
        ],
        examples: [
            "a Soviet probe landed there and lasted two hours",
            "NASA studied a floating station idea",
            "clouds of acid cover the whole planet",
            "one mission sent back the first photos",
        ],
    },
    Topic {
        name: "facial recognition in schools",
        group: "teachers",
        pros: [
            "help teachers see when students are confused",
            "make classrooms safer",
            "save time on attendance",
            "improve online lessons",
        ],
        cons: [
            "invade students' privacy",
            "make mistakes with some faces",
            "store data that could be stolen",
            "make students feel watched",
        ],
        examples: [
            "a program read the smile on a famous painting",
            "my school tested cameras at the entrance",
            "a computer guessed my mood wrong",
            "a company lost the photos of thousands of people",
        ],
    },
    Topic {
        name: "summer projects designed by students",
        group: "students",
        pros: [
            "let students follow their interests",
            "keep students learning over the break",
            "build creativity",
            "make students proud of their work",
        ],
        cons: [
            "let some students do very little",
            "be hard for teachers to grade",
            "leave students without guidance",
            "add stress to the holidays",
        ],
        examples: [
            "I built a birdhouse and wrote about it",
            "my friend did the minimum and got an A",
            "a teacher gave us a list of ideas",
            "my class shared projects in the fall",
        ],
    },
    Topic {
        name: "asking several people for advice",
        group: "people",
        pros: [
            "give us more points of view",
            "help us avoid mistakes",
            "make us more confident",
            "show us options we missed",
        ],
        cons: [
            "confuse us with different answers",
            "take a long time",
            "make it hard to decide",
            "let others make our choices",
        ],
        examples: [
            "I asked three friends about which class to take",
            "my mom asked our family before changing jobs",
            "a coach and a teacher told me opposite things",
            "my friend asked everyone and still could not choose",
        ],
    },
    Topic {
        name: "a later school start time",
        group: "students",
        pros: [
            "let teenagers get enough sleep",
            "improve attendance",
            "reduce car accidents among teens",
            "help students focus in the morning",
        ],
        cons: [
            "push sports practice into the evening",
            "make it hard for parents who work early",
            "cost more for buses",
            "cut into time for jobs",
        ],
        examples: [
            "a school in Seattle moved its start to 8:45",
            "I fell asleep in first period twice last week",
            "my team practiced until dark",
            "my dad has to leave for work at seven",
        ],
    },
    Topic {
        name: "school uniforms",
        group: "students",
        pros: [
            "reduce bullying about clothes",
            "save families money",
            "make mornings faster",
            "build school spirit",
        ],
        cons: [
            "limit how students express themselves",
            "cost a lot at the start",
            "feel uncomfortable",
            "do nothing to improve grades",
        ],
        examples: [
            "my old school switched to uniforms in sixth grade",
            "a girl in my class was teased for her shoes",
            "my parents bought five shirts in August",
            "students wore their own clothes on spirit day",
        ],
    },
];

/// Openers per class (cue words; `{T}` and the other slots may appear).
fn openers(class: usize) -> &'static [&'static str] {
    match class {
        0 => &[
            "Have you ever wondered about {T}?",
            "Many people today are talking about {T}.",
            "Imagine a world where everyone has an opinion on {T}.",
            "When I first heard about {T}, I was surprised.",
            "It seems like {T} comes up everywhere these days.",
        ],
        1 => &[
            "I believe that",
            "In my opinion,",
            "I strongly feel that",
            "My position is that",
            "It is clear to me that",
        ],
        2 => {
            &["First,", "Another reason is that", "Also,", "Most importantly,", "On top of that,", "Finally,"]
        }
        3 => &[
            "Some people say that",
            "Others argue that",
            "Critics claim that",
            "It is true that some think",
            "Opponents would say that",
        ],
        4 => &["However,", "But", "Even so,", "That may be true, but", "Still,"],
        5 => &["For example,", "For instance,", "I remember when", "One time,", "Last year,"],
        _ => &["In conclusion,", "To sum up,", "For all these reasons,", "Overall,", "In the end,"],
    }
}

/// Cores per class: the rest of the sentence.
fn cores(class: usize) -> &'static [&'static str] {
    match class {
        0 => &[
            "It is a question that matters to {G}.",
            "Some love the idea and some hate it.",
            "The answer is not as simple as it seems.",
            "Everyone seems to have a strong opinion.",
        ],
        1 => &[
            "{T} {S}.",
            "{T} {S} for several reasons.",
            "{T} {S} and I will explain why.",
            "we should agree that {T} {S}.",
        ],
        2 => &[
            "{T} can {R}.",
            "it would {R}, which matters a lot.",
            "{T} will {R} for many {G}.",
            "the biggest benefit is that it can {R}.",
        ],
        3 => &[
            "{T} would {O}.",
            "it will {O} for many {G}.",
            "{T} might {O}, which is a real worry.",
            "it could {O} if we are not careful.",
        ],
        4 => &[
            "{B}.",
            "{B}, so the worry is not convincing.",
            "this ignores that {B}.",
            "{B}, which critics often forget.",
        ],
        5 => &[
            "{E}.",
            "{E}, and it showed me how much this matters.",
            "{E} and everyone noticed the result.",
            "{E}, which proves the point.",
        ],
        _ => &[
            "{T} {S}.",
            "I still think {T} {S} because it can {R}.",
            "{T} {S}, and I hope others agree.",
            "{T} {S} for the {G} who need it.",
        ],
    }
}

/// Rebuttal points (`{B}`).
const REBUTTALS: [&str; 6] = [
    "the benefits are much bigger than the problems",
    "clear rules can fix most of these issues",
    "this only happens to a few {G}",
    "the same is true of many things we already accept",
    "schools can plan ahead for this",
    "there is little evidence that this really happens",
];

/// The chance that a later sentence of a multi-sentence element is annotated as a new element
/// of the same class: label noise no text reveals, as annotators of the real data disagreed on
/// where one Evidence ends and the next begins.
pub const ANNOTATOR_SPLIT_P: f64 = 0.2;

/// Lines outside every element.
const FILLERS: [&str; 4] =
    ["Dear Principal,", "Thank you for reading.", "Sincerely, a student", "Dear Senator,"];

/// Whether the pair (opener `i`, core `j`) is held out.
fn heldout_pair(i: usize, j: usize) -> bool {
    (i + j).is_multiple_of(3)
}

/// What the slots of one essay are filled with.
struct Fill<'a> {
    topic: &'a Topic,
    stance: &'static str,
    reasons: [&'static str; 4],
    opposing: [&'static str; 4],
}

impl Fill<'_> {
    fn fill(&self, template: &str, rng: &mut ChaCha8Rng) -> String {
        let mut s = template.replace("{B}", REBUTTALS[rng.gen_range(0..REBUTTALS.len())]);
        for (slot, options) in
            [("{R}", &self.reasons), ("{O}", &self.opposing), ("{E}", &self.topic.examples)]
        {
            while let Some(at) = s.find(slot) {
                s.replace_range(at..at + slot.len(), options[rng.gen_range(0..4)]);
            }
        }
        s.replace("{T}", self.topic.name).replace("{S}", self.stance).replace("{G}", self.topic.group)
    }
}

/// One sentence of `class`: an opener and a core of the split's pairs, filled in.
fn sentence(class: usize, heldout: bool, fill: &Fill, rng: &mut ChaCha8Rng) -> String {
    let (os, cs) = (openers(class), cores(class));
    let pairs: Vec<(usize, usize)> = (0..os.len())
        .flat_map(|i| (0..cs.len()).map(move |j| (i, j)))
        .filter(|&(i, j)| heldout_pair(i, j) == heldout)
        .collect();
    let (i, j) = pairs[rng.gen_range(0..pairs.len())];
    let opener = fill.fill(os[i], rng);
    let core = fill.fill(cs[j], rng);
    // Leads are two sentences; the other openers lead into their core.
    let text = format!("{opener} {core}");
    let mut chars = text.chars();
    match chars.next() {
        Some(c) => c.to_uppercase().collect::<String>() + chars.as_str(),
        None => text,
    }
}

/// Splits a sentence into one or two segments at a clause boundary (probability 0.7 when a
/// boundary leaves at least three words on each side).
fn split_sentence(s: &str, rng: &mut ChaCha8Rng) -> Vec<String> {
    let words: Vec<&str> = s.split_whitespace().collect();
    let cuts: Vec<usize> = (3..words.len().saturating_sub(2))
        .filter(|&k| {
            words[k - 1].ends_with([',', '?', '.'])
                || ["because", "which", "and", "but", "so"].contains(&words[k])
        })
        .collect();
    if cuts.is_empty() || rng.gen::<f64>() >= 0.7 {
        return vec![s.to_string()];
    }
    let k = cuts[rng.gen_range(0..cuts.len())];
    vec![words[..k].join(" "), words[k..].join(" ")]
}

/// The essay of `seed` (held-out combinations when `heldout`).
pub fn generate(seed: u64, heldout: bool) -> Essay {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_e55a);
    let topic = &TOPICS[rng.gen_range(0..TOPICS.len())];
    let pro = rng.gen_bool(0.5);
    let fill = Fill {
        topic,
        stance: if pro {
            ["should be allowed", "is a good idea", "would help everyone"][rng.gen_range(0..3)]
        } else {
            ["should not be allowed", "is a bad idea", "would do more harm than good"][rng.gen_range(0..3)]
        },
        reasons: if pro { topic.pros } else { topic.cons },
        opposing: if pro { topic.cons } else { topic.pros },
    };
    // The element plan: (class, sentences).
    let mut plan: Vec<(usize, usize)> = Vec::new();
    if rng.gen_bool(0.7) {
        plan.push((0, 1));
    }
    plan.push((1, 1));
    let claims = rng.gen_range(1..=3);
    let counter_at = rng.gen_bool(0.5).then(|| rng.gen_range(0..=claims));
    for c in 0..=claims {
        if counter_at == Some(c) {
            plan.push((3, 1));
            plan.push((4, rng.gen_range(1..=2)));
        }
        if c < claims {
            plan.push((2, 1));
            if rng.gen_bool(0.85) {
                plan.push((5, rng.gen_range(1..=3)));
            }
        }
    }
    plan.push((6, rng.gen_range(1..=2)));

    let mut segments = Vec::new();
    let push_filler = |segments: &mut Vec<Segment>, rng: &mut ChaCha8Rng| {
        segments.push(Segment {
            text: FILLERS[rng.gen_range(0..FILLERS.len())].into(),
            class: NONE,
            begin: false,
        });
    };
    if rng.gen_bool(0.15) {
        push_filler(&mut segments, &mut rng);
    }
    for (class, sentences) in plan {
        for k in 0..sentences {
            // Annotators disagree: a later sentence of an element is sometimes its own element.
            let mut first = k == 0 || rng.gen_bool(ANNOTATOR_SPLIT_P);
            let s = sentence(class, heldout, &fill, &mut rng);
            for piece in split_sentence(&s, &mut rng) {
                segments.push(Segment { text: piece, class, begin: first });
                first = false;
            }
        }
    }
    if rng.gen_bool(0.15) {
        push_filler(&mut segments, &mut rng);
    }
    Essay::new(seed, segments)
}
