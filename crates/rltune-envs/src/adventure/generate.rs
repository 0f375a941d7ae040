//! Building a game from a seed: a random tree of rooms on a grid, doors, furniture, items,
//! the quest's target and goal, and the quest itself.
//!
//! Invariants the quest relies on (each milestone is a precondition of the next, so the
//! in-order progress counter of `World::advance` never skips one):
//! - the map is a tree; the target lies in a room other than the start (when there are two);
//! - the quest door lies on the one path from the start to the target's room;
//! - the quest door's key lies on the start's side of that door, and no other door is locked.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::text;
use super::world::{Dir, Door, DoorState, Exit, Kind, Loc, Milestone, Object, Room, State, World};
use super::AdventureConfig;

/// Chance that a corridor off the quest path also has a (closed, unlocked) door.
const EXTRA_DOOR_P: f64 = 0.25;
/// Chance that a distractor is furniture rather than an item.
const FURNITURE_P: f64 = 0.3;

/// `n` distinct entries of `list` in random order (`n <= list.len()`).
fn pick<T: Copy>(rng: &mut ChaCha8Rng, list: &[T], n: usize) -> Vec<T> {
    let mut v = list.to_vec();
    for i in 0..n.min(v.len()) {
        let j = rng.gen_range(i..v.len());
        v.swap(i, j);
    }
    v.truncate(n);
    v
}

/// A random tree of `n` rooms on the grid: edges `(a, direction from a, b)`.
fn grid_tree(rng: &mut ChaCha8Rng, n: usize) -> Vec<(usize, Dir, usize)> {
    let mut cells = vec![(0i32, 0i32)];
    let mut edges = Vec::new();
    let next = |c: (i32, i32), d: Dir| (c.0 + d.delta().0, c.1 + d.delta().1);
    while cells.len() < n {
        // never empty: a finite set of cells always has a free neighbour
        let frontier: Vec<(usize, Dir)> = (0..cells.len())
            .flat_map(|i| Dir::ALL.map(|d| (i, d)))
            .filter(|&(i, d)| !cells.contains(&next(cells[i], d)))
            .collect();
        let (a, d) = frontier[rng.gen_range(0..frontier.len())];
        cells.push(next(cells[a], d));
        edges.push((a, d, cells.len() - 1));
    }
    edges
}

/// The edges at room `r`, as `(edge index, the room at its other end)`.
fn neighbours(edges: &[(usize, Dir, usize)], r: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    edges.iter().enumerate().filter_map(move |(e, &(a, _, b))| {
        if a == r {
            Some((e, b))
        } else if b == r {
            Some((e, a))
        } else {
            None
        }
    })
}

/// The edges on the tree path from `from` to `to`.
fn tree_path(edges: &[(usize, Dir, usize)], n: usize, from: usize, to: usize) -> Vec<usize> {
    // parent[r] = (parent room, edge) in a search from `from`
    let mut parent: Vec<Option<(usize, usize)>> = vec![None; n];
    let mut stack = vec![from];
    let mut seen = vec![false; n];
    seen[from] = true;
    while let Some(r) = stack.pop() {
        for (e, other) in neighbours(edges, r) {
            if !seen[other] {
                seen[other] = true;
                parent[other] = Some((r, e));
                stack.push(other);
            }
        }
    }
    let mut path = Vec::new();
    let mut r = to;
    while let Some((p, e)) = parent[r] {
        path.push(e);
        r = p;
    }
    path
}

/// The rooms reachable from `from` without crossing edge `cut`.
fn side_of(edges: &[(usize, Dir, usize)], n: usize, from: usize, cut: usize) -> Vec<usize> {
    let mut seen = vec![false; n];
    seen[from] = true;
    let mut stack = vec![from];
    while let Some(r) = stack.pop() {
        for (e, other) in neighbours(edges, r) {
            if e != cut && !seen[other] {
                seen[other] = true;
                stack.push(other);
            }
        }
    }
    (0..n).filter(|&r| seen[r]).collect()
}

/// Objects and their start locations, built up in order.
struct Placer {
    objects: Vec<Object>,
    locs: Vec<Loc>,
}

impl Placer {
    fn add(&mut self, name: String, kind: Kind, looks: &'static str, loc: Loc) -> usize {
        self.objects.push(Object { name, kind, looks });
        self.locs.push(loc);
        self.objects.len() - 1
    }

    /// A random spot in `room`: the floor or any furniture there except `not`.
    fn spot(&self, rng: &mut ChaCha8Rng, room: usize, not: Option<usize>) -> Loc {
        let mut spots = vec![Loc::Floor(room)];
        spots.extend(
            (0..self.objects.len())
                .filter(|&f| self.objects[f].kind.is_furniture() && self.locs[f] == Loc::Floor(room))
                .filter(|&f| Some(f) != not)
                .map(Loc::In),
        );
        spots[rng.gen_range(0..spots.len())]
    }
}

/// The game for `seed` (the config is validated).
pub(super) fn generate(seed: u64, cfg: &AdventureConfig) -> World {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = cfg.rooms;
    let edges = grid_tree(&mut rng, n);
    let names = pick(&mut rng, &text::ROOMS, n);
    let mut rooms: Vec<Room> = names
        .iter()
        .map(|&name| Room {
            name,
            flavour: text::FLAVOURS[rng.gen_range(0..text::FLAVOURS.len())],
            exits: [None; 4],
        })
        .collect();

    let start = rng.gen_range(0..n);
    let target_room = if n > 1 { (start + rng.gen_range(1..n)) % n } else { start };
    let path = tree_path(&edges, n, start, target_room);
    let quest_edge = (cfg.doors && !path.is_empty()).then(|| path[rng.gen_range(0..path.len())]);

    // doors on the quest edge and, now and then, on the others
    let materials = pick(&mut rng, &text::DOOR_MATERIALS, edges.len());
    let mut doors = Vec::new();
    let mut door_states = Vec::new();
    let mut quest_door = None;
    for (e, &(a, d, b)) in edges.iter().enumerate() {
        let is_quest = Some(e) == quest_edge;
        let door = (is_quest || (cfg.doors && rng.gen_bool(EXTRA_DOOR_P))).then(|| {
            doors.push(Door { name: format!("{} door", materials[e]) });
            let locked = is_quest && cfg.locked_doors;
            door_states.push(if locked { DoorState::Locked } else { DoorState::Closed });
            doors.len() - 1
        });
        if is_quest {
            quest_door = door;
        }
        rooms[a].exits[d as usize] = Some(Exit { to: b, door });
        rooms[b].exits[d.opposite() as usize] = Some(Exit { to: a, door });
    }

    // furniture: the goal, then distractor furniture; then the key, target and other items
    let mut placer = Placer { objects: Vec::new(), locs: Vec::new() };
    let furniture = pick(&mut rng, &text::FURNITURE, text::FURNITURE.len());
    let item_nouns = pick(&mut rng, &text::ITEMS, text::ITEMS.len());
    let mut furniture = furniture.into_iter();
    let mut items = item_nouns.into_iter();
    let mut add_furniture = |rng: &mut ChaCha8Rng, placer: &mut Placer| {
        let (name, kind) = furniture.next().unwrap_or(("stool", Kind::Supporter));
        placer.add(name.into(), kind, "", Loc::Floor(rng.gen_range(0..n)))
    };
    let goal = add_furniture(&mut rng, &mut placer);
    let furniture_distractors = (0..cfg.distractors).filter(|_| rng.gen_bool(FURNITURE_P)).count();
    for _ in 0..furniture_distractors {
        add_furniture(&mut rng, &mut placer);
    }
    let key = match (quest_door, quest_edge) {
        (Some(door), Some(edge)) if cfg.locked_doors => {
            let side = side_of(&edges, n, start, edge);
            let room = side[rng.gen_range(0..side.len())];
            let metal = text::KEY_METALS[rng.gen_range(0..text::KEY_METALS.len())];
            let loc = placer.spot(&mut rng, room, None);
            Some(placer.add(format!("{metal} key"), Kind::Key(door), "", loc))
        }
        _ => None,
    };
    let mut add_item = |rng: &mut ChaCha8Rng, placer: &mut Placer, room: usize, not: Option<usize>| {
        let noun = items.next().unwrap_or("pebble");
        let adjective = text::ADJECTIVES[rng.gen_range(0..text::ADJECTIVES.len())];
        let looks = text::ITEM_LOOKS[rng.gen_range(0..text::ITEM_LOOKS.len())];
        let loc = placer.spot(rng, room, not);
        placer.add(format!("{adjective} {noun}"), Kind::Item, looks, loc)
    };
    let target = add_item(&mut rng, &mut placer, target_room, Some(goal));
    for _ in furniture_distractors..cfg.distractors {
        let room = rng.gen_range(0..n);
        add_item(&mut rng, &mut placer, room, None);
    }
    if cfg.trap {
        let food = text::FOODS[rng.gen_range(0..text::FOODS.len())];
        let room = rng.gen_range(0..n);
        let loc = placer.spot(&mut rng, room, None);
        placer.add(format!("rotten {food}"), Kind::Rotten, "", loc);
    }

    // the quest: the last `quest_length` milestones of the full chain
    let mut chain = Vec::new();
    if let (Some(key), Some(door)) = (key, quest_door) {
        chain.extend([Milestone::Holding(key), Milestone::Unlocked(door)]);
    }
    chain.extend(quest_door.map(Milestone::Opened));
    if target_room != start {
        chain.push(Milestone::Entered(target_room));
    }
    chain.extend([Milestone::Holding(target), Milestone::Placed(target, goal)]);
    let quest = chain.split_off(chain.len().saturating_sub(cfg.quest_length));

    let start = State { room: start, locs: placer.locs, doors: door_states, progress: 0, lost: false };
    let mut world = World { rooms, objects: placer.objects, doors, quest, target, goal, start };
    let mut first = world.start.clone();
    world.advance(&mut first);
    world.start = first;
    world
}

/// The longest quest `cfg` allows: deliver (2), enter the target's room (1 with two rooms or
/// more), open the door (1 with doors), take the key and unlock (2 with locked doors).
pub(super) fn max_quest_length(cfg: &AdventureConfig) -> usize {
    2 + usize::from(cfg.rooms >= 2) + usize::from(cfg.doors) + 2 * usize::from(cfg.locked_doors)
}

/// The sentence naming the goal.
pub(super) fn objective(world: &World) -> String {
    let goal = &world.objects[world.goal];
    let room = world.room_of(&world.start, world.goal).map_or("house", |r| world.rooms[r].name);
    format!(
        "Find the {} and put it {} the {} in the {room}.",
        world.objects[world.target].name,
        goal.kind.preposition(),
        goal.name
    )
}
